import { randomUUID } from 'node:crypto'
import { fingerprintsEqual } from '../lib/fingerprint.js'
import { HeaderSets, OWN_BUFFER_OVERHEAD, Slabs, type HeaderSet } from './memory-packing.js'
import { compactKey, Records, type Bucket } from './memory-records.js'
import { InvalidOptionError } from '../lib/errors.js'
import { integerOption, MAX_TIMER_MS } from '../lib/validate.js'
import type { InspectedRecord, RecoveryTools } from '../lib/admin.js'
import { reconcileWith, startReconcilerWith, type ReconcileOptions, type ReconcilerOptions, type ReconcileSource } from '../lib/reconcile.js'
import type {
  ClaimRequest, ClaimResult, Fingerprint, IdempotencyStore, Lease, RecordId, StepResults, StoredRecord, StoredResponse, SyncOperations
} from '../lib/store.js'

export interface MemoryStoreOptions {
  /** Most records held at once; when full (after dropping expired ones) new claims are refused. @defaultValue 1_000_000 */
  maxEntries?: number
  /** Approximate bytes of keys, headers and bodies held at once; same refusal when exceeded. @defaultValue 805_306_368 (768 MiB: room for the default maxEntries of small records) */
  maxBytes?: number
  /**
   * Most records one scope (tenant) holds at once; past it that scope's new claims are refused, and
   * only that scope's, so one tenant cannot fill the store for every tenant. Set it to `maxEntries`
   * to let one scope use the whole store (an unscoped app: every record is in the scope `''`).
   * @defaultValue a quarter of maxEntries
   */
  maxEntriesPerScope?: number
  /** Approximate bytes one scope holds at once; same refusal, for that scope only. @defaultValue a quarter of maxBytes */
  maxBytesPerScope?: number
  /** How often expired records are swept, in ms; 0 disables the timer (reads still honour expiry). @defaultValue 60_000 */
  purgeInterval?: number
  /** The clock, in ms since the epoch. Tests inject one to move time. @defaultValue Date.now */
  now?: () => number
}

/** What the store holds now, as it counts it against its bounds. */
export interface MemoryStoreUsage {
  readonly records: number
  /** The bytes counted against `maxBytes`. */
  readonly bytes: number
  /** Scopes holding at least one record. */
  readonly scopes: number
}

/** The memory store: the plugin's store contract, recovery points, and the operator tools. */
export interface MemoryStore extends IdempotencyStore, RecoveryTools {
  loadSteps (lease: Lease): Promise<StepResults | null>
  saveStep (lease: Lease, name: string, resultJson: string): Promise<boolean>
  hold (lease: Lease): Promise<boolean>
  /** What the store holds now (records, counted bytes, scopes): for a gauge, or an alert before it is full. */
  usage (): MemoryStoreUsage
}

/**
 * Thrown by `claim` when the memory store, or the claiming scope's share of it, is full of
 * unexpired records: nothing live is ever dropped.
 */
export class MemoryStoreFullError extends Error {
  readonly code = 'FST_IDEMPOTENCY_MEMORY_STORE_FULL'
  /** True when only the claiming scope was refused (it holds its share); false when the whole store is full. */
  readonly scoped: boolean

  constructor (limit: string, scoped = false) {
    super(scoped
      ? `fastify-idempotency: this scope holds its share of the memory store (${limit}); no unexpired record is dropped, so its new keys are refused until its records expire (other scopes are served)`
      : `fastify-idempotency: the memory store is full (${limit}); no unexpired record is dropped, so new keys are refused until records expire`)
    this.name = 'MemoryStoreFullError'
    this.scoped = scoped
  }
}

interface Entry {
  /** The scope's bucket (its scope, and what the scope holds). */
  readonly bucket: Bucket<Entry>
  readonly key: string
  state: 'in_progress' | 'completed'
  /** In progress: the request's fingerprint. Completed: null, its digest is packed with the body. */
  fingerprint: Fingerprint | null
  readonly algorithm: string
  token: string
  leaseUntil: number
  expiresAt: number
  /**
   * Completed: the slab holding the digest bytes followed by the body bytes, at `offset`, `length`
   * bytes in all (see memory-packing.ts). Views on it are made when a record is read, so a record
   * holds no Buffer object of its own.
   */
  slab: Buffer | null
  offset: number
  length: number
  digestLength: number
  /** Completed: false when the body was not retained (over maxResponseBytes). */
  retained: boolean
  statusCode: number
  /** Completed: the recorded headers, frozen deep down and shared with identical sets (memory-packing.ts). */
  headers: HeaderSet | null
  /** Counted against maxBytes, and against its scope's maxBytesPerScope. */
  bytes: number
  /** In progress: recorded step results (JSON text by name), or null before the first. */
  steps: Map<string, string> | null
  /** In progress: held for the reconciler after an indeterminate failure; never taken over by a retry. */
  indeterminate: boolean
  createdAt: number
}

/** Every memory store made, so the plugin can warn where one cannot be shared (production, a cluster worker). */
const stores = new WeakSet<object>()

export function isMemoryStore (store: unknown): boolean {
  return typeof store === 'object' && store !== null && stores.has(store)
}

/** Per-record bookkeeping (Map slot, entry object, timestamps) counted against `maxBytes`. */
const ENTRY_OVERHEAD = 160
const SWEEP_SLICE = 10_000
/** The default per-scope bounds are this fraction of the store's: four tenants at their share fill it. */
const SCOPE_SHARE = 4
const NO_HEADERS: Readonly<Record<string, string>> = Object.freeze({})

/**
 * The embedded default: one process, nothing to install. Every operation runs synchronously inside
 * one call, so claims are atomic with respect to each other within the process; it is not shared
 * between processes (use the Postgres driver for several instances).
 */
export function memoryStore (options: MemoryStoreOptions = {}): MemoryStore {
  const maxEntries = integerOption('memoryStore option "maxEntries"', options.maxEntries, 1_000_000, 1, Number.MAX_SAFE_INTEGER)
  const maxBytes = integerOption('memoryStore option "maxBytes"', options.maxBytes, 768 * 1024 * 1024, 1, Number.MAX_SAFE_INTEGER, 'bytes')
  // Issue 16: with one global bound, a tenant that filled the store (768 requests of 1 MiB took
  // 14 s) had every tenant answered 503 until its records expired. Each scope is bounded to a share.
  const maxEntriesPerScope = integerOption('memoryStore option "maxEntriesPerScope"', options.maxEntriesPerScope, Math.max(1, Math.floor(maxEntries / SCOPE_SHARE)), 1, Number.MAX_SAFE_INTEGER)
  const maxBytesPerScope = integerOption('memoryStore option "maxBytesPerScope"', options.maxBytesPerScope, Math.max(1, Math.floor(maxBytes / SCOPE_SHARE)), 1, Number.MAX_SAFE_INTEGER, 'bytes')
  const purgeInterval = integerOption('memoryStore option "purgeInterval"', options.purgeInterval, 60_000, 0, MAX_TIMER_MS, 'ms')
  const now = options.now ?? Date.now
  if (typeof now !== 'function') throw new InvalidOptionError('memoryStore option "now"', 'a function returning ms since the epoch', now)

  const entries = new Records<Entry>()
  const slabs = new Slabs()
  const headerSets = new HeaderSets()
  let bytes = 0
  let lastFullPurge = -Infinity
  let sweeping = false
  let closed = false

  const timer = purgeInterval > 0 ? setInterval(sweep, purgeInterval) : null
  timer?.unref()

  function live (scope: string, key: string, at: number): Entry | undefined {
    return unexpired(entries.get(scope, key), at)
  }

  function unexpired (entry: Entry | undefined, at: number): Entry | undefined {
    if (entry !== undefined && entry.expiresAt <= at) {
      drop(entry)
      return undefined
    }
    return entry
  }

  function drop (entry: Entry): void {
    if (!entries.delete(entry)) return
    count(entry, -entry.bytes)
    if (entry.headers !== null) headerSets.release(entry.headers)
  }

  /** Counts `size` more bytes (fewer when negative) for the record, its scope and the store. */
  function count (entry: Entry, size: number): void {
    entry.bytes += size
    entry.bucket.bytes += size
    bytes += size
  }

  function owned (lease: Lease, at: number): Entry | undefined {
    const entry = live(lease.scope, lease.key, at)
    return entry !== undefined && entry.state === 'in_progress' && entry.token === lease.token ? entry : undefined
  }

  /**
   * Room for one more record of `bucket`'s scope, or a MemoryStoreFullError. Four counters on the
   * hot path; a scan only when a bound is reached. No live record is ever dropped to make room (it
   * would let its operation run again): not another scope's, and not the claiming scope's own.
   */
  function makeRoom (bucket: Bucket<Entry>, at: number): void {
    if (entries.size < maxEntries && bytes < maxBytes && bucket.keys.size < maxEntriesPerScope && bucket.bytes < maxBytesPerScope) return
    if (entries.size >= maxEntries || bytes >= maxBytes) {
      // A full scan at most once a second, so a store full of live records refuses quickly.
      if (at - lastFullPurge >= 1000) {
        lastFullPurge = at
        purge(Infinity, at)
      }
      if (entries.size >= maxEntries) throw new MemoryStoreFullError(`${maxEntries} records`)
      if (bytes >= maxBytes) throw new MemoryStoreFullError(`${maxBytes} bytes`)
    }
    if (bucket.keys.size >= maxEntriesPerScope || bucket.bytes >= maxBytesPerScope) {
      // The scope's own records only, at most once a second per scope: a tenant at its share pays
      // for scanning what it holds, and nobody else does.
      if (at - bucket.lastPurge >= 1000) {
        bucket.lastPurge = at
        for (const entry of bucket.keys.values()) if (entry.expiresAt <= at) drop(entry)
      }
      if (bucket.keys.size >= maxEntriesPerScope) throw new MemoryStoreFullError(`maxEntriesPerScope: ${maxEntriesPerScope} records`, true)
      if (bucket.bytes >= maxBytesPerScope) throw new MemoryStoreFullError(`maxBytesPerScope: ${maxBytesPerScope} bytes`, true)
    }
  }

  function purge (limit: number, at: number): number {
    let purged = 0
    for (const entry of entries) {
      if (purged >= limit) break
      if (entry.expiresAt <= at) {
        drop(entry)
        purged++
      }
    }
    return purged
  }

  // The timer sweeps in slices, yielding to the event loop between them, so claims never wait
  // behind a scan of a large map.
  function sweep (): void {
    if (sweeping || closed) return
    sweeping = true
    const iterator = entries[Symbol.iterator]()
    const step = (): void => {
      if (closed) { sweeping = false; return }
      const at = now()
      for (let i = 0; i < SWEEP_SLICE; i++) {
        const next = iterator.next()
        if (next.done === true) { sweeping = false; return }
        if (next.value.expiresAt <= at) drop(next.value)
      }
      setImmediate(step).unref()
    }
    step()
  }

  function recordOf (entry: Entry, at: number): StoredRecord {
    return entry.state === 'completed'
      ? { state: 'completed', fingerprint: fingerprintOf(entry), response: responseOf(entry) }
      : { state: 'in_progress', fingerprint: fingerprintOf(entry), leaseRemainingMs: Math.max(0, entry.leaseUntil - at) }
  }

  function dropSteps (entry: Entry): void {
    if (entry.steps === null) return
    let size = 0
    for (const [name, json] of entry.steps) size += (name.length + json.length) * 2
    entry.steps = null
    count(entry, -size)
  }


  const reconcileSource: ReconcileSource = {
    async findStuck (olderThanMs, limit) {
      const at = now()
      const found: Array<RecordId & { token: string }> = []
      for (const entry of entries) {
        if (found.length >= limit) break
        if (entry.state === 'in_progress' && entry.expiresAt > at && entry.leaseUntil + olderThanMs <= at) {
          found.push({ scope: entry.bucket.scope, key: entry.key, token: entry.token })
        }
      }
      return found
    },
    async acquire (candidate, olderThanMs, leaseMs) {
      const at = now()
      const entry = live(candidate.scope, candidate.key, at)
      if (entry === undefined || entry.state !== 'in_progress' || entry.token !== candidate.token || entry.leaseUntil + olderThanMs > at) return null
      entry.token = randomUUID()
      entry.leaseUntil = at + leaseMs
      outliveLease(entry)
      return {
        lease: { scope: candidate.scope, key: candidate.key, token: entry.token },
        fingerprint: fingerprintOf(entry),
        steps: stepsOf(entry),
        indeterminate: entry.indeterminate,
        createdAt: new Date(entry.createdAt)
      }
    },
    complete: (lease, response, ttlMs) => store.complete(lease, response, ttlMs),
    release: (lease) => store.release(lease),
    async resume (lease, ttlMs) {
      const at = now()
      const entry = owned(lease, at)
      if (entry === undefined) return false
      entry.indeterminate = false
      entry.leaseUntil = at
      // No longer held: it expires again, but not before a retry had the time to take it over.
      entry.expiresAt = Number.isFinite(entry.expiresAt) ? Math.max(entry.expiresAt, at + ttlMs) : at + ttlMs
      return true
    },
    async leave (lease, wasIndeterminate) {
      const entry = owned(lease, now())
      if (entry === undefined) return false
      entry.indeterminate = wasIndeterminate
      entry.leaseUntil = now()
      return true
    }
  }

  // Every operation runs synchronously within one call; the plugin calls these directly (lib/store.ts).
  function claim (request: ClaimRequest): ClaimResult {
    const at = now()
    const bucket = entries.bucketOf(request.scope)
    const entry = unexpired(bucket.keys.get(request.key), at)
    if (entry === undefined) {
      makeRoom(bucket, at)
      const token = randomUUID()
      const created: Entry = {
        bucket,
        key: compactKey(request.key),
        state: 'in_progress',
        fingerprint: request.fingerprint,
        algorithm: request.fingerprint.algorithm,
        token,
        leaseUntil: at + request.leaseMs,
        expiresAt: at + request.ttlMs,
        slab: null,
        offset: 0,
        length: 0,
        digestLength: 0,
        retained: false,
        statusCode: 0,
        headers: null,
        bytes: 0,
        steps: null,
        indeterminate: false,
        createdAt: at
      }
      outliveLease(created)
      entries.add(created)
      count(created, ENTRY_OVERHEAD + (request.scope.length + request.key.length) * 2)
      return { outcome: 'acquired', lease: { scope: request.scope, key: request.key, token }, takeover: false }
    }
    if (entry.state === 'in_progress' && entry.leaseUntil <= at && !entry.indeterminate && fingerprintsEqual(fingerprintOf(entry), request.fingerprint)) {
      entry.token = randomUUID()
      entry.leaseUntil = at + request.leaseMs
      // The record lives at least a ttl from now, as a newly created one would.
      entry.expiresAt = Math.max(entry.expiresAt, at + request.ttlMs)
      outliveLease(entry)
      return { outcome: 'acquired', lease: { scope: request.scope, key: request.key, token: entry.token }, takeover: true }
    }
    if (entry.state === 'completed') {
      return { outcome: 'completed', fingerprint: fingerprintOf(entry), response: responseOf(entry), expiresInMs: entry.expiresAt - at }
    }
    return { outcome: 'in_progress', fingerprint: fingerprintOf(entry), leaseRemainingMs: Math.max(0, entry.leaseUntil - at) }
  }

  function complete (lease: Lease, response: StoredResponse, ttlMs: number): boolean {
    const at = now()
    const entry = owned(lease, at)
    if (entry === undefined) return false
    const digest = (entry.fingerprint as Fingerprint).digest
    entry.offset = slabs.pack(digest, response.body, ttlMs)
    entry.slab = slabs.last
    entry.length = digest.length + (response.body?.length ?? 0)
    entry.digestLength = digest.length
    entry.retained = response.body !== null
    entry.statusCode = response.statusCode
    entry.headers = headerSets.intern(response.headers)
    entry.fingerprint = null
    entry.token = ''
    dropSteps(entry)
    entry.state = 'completed'
    entry.expiresAt = at + ttlMs
    count(entry, entry.length + entry.headers.bytes + (slabs.own ? OWN_BUFFER_OVERHEAD : 0))
    return true
  }

  function release (lease: Lease): boolean {
    const entry = owned(lease, now())
    if (entry === undefined) return false
    drop(entry)
    return true
  }

  const store: MemoryStore = {
    async claim (request: ClaimRequest): Promise<ClaimResult> {
      return claim(request)
    },

    async complete (lease: Lease, response: StoredResponse, ttlMs: number): Promise<boolean> {
      return complete(lease, response, ttlMs)
    },

    async release (lease: Lease): Promise<boolean> {
      return release(lease)
    },

    async renew (lease: Lease, leaseMs: number): Promise<boolean> {
      const at = now()
      const entry = owned(lease, at)
      if (entry === undefined) return false
      entry.leaseUntil = at + leaseMs
      outliveLease(entry)
      return true
    },

    async get (id: RecordId): Promise<StoredRecord | null> {
      const at = now()
      const entry = live(id.scope, id.key, at)
      return entry === undefined ? null : recordOf(entry, at)
    },

    async purgeExpired (limit = Infinity): Promise<number> {
      return purge(limit, now())
    },

    async loadSteps (lease: Lease): Promise<StepResults | null> {
      const entry = owned(lease, now())
      return entry === undefined ? null : stepsOf(entry)
    },

    async saveStep (lease: Lease, name: string, resultJson: string): Promise<boolean> {
      const entry = owned(lease, now())
      if (entry === undefined || entry.steps?.has(name) === true) return false
      entry.steps ??= new Map()
      entry.steps.set(name, resultJson)
      count(entry, (name.length + resultJson.length) * 2)
      return true
    },

    async hold (lease: Lease): Promise<boolean> {
      const at = now()
      const entry = owned(lease, at)
      if (entry === undefined) return false
      entry.indeterminate = true
      entry.leaseUntil = at
      // Never expires while held: reclaimed as a fresh record at its ttl, it would lose its steps and
      // a retry would repeat effects that happened. The reconciler or an operator resolves it.
      entry.expiresAt = Infinity
      return true
    },

    async inspect (id: RecordId): Promise<InspectedRecord | null> {
      const at = now()
      const entry = live(id.scope, id.key, at)
      return entry === undefined ? null : inspected(id, entry, at)
    },

    async listHeld (limit?: number): Promise<InspectedRecord[]> {
      const most = integerOption('memoryStore.listHeld(limit)', limit, 100, 1, 100_000)
      const at = now()
      const held: InspectedRecord[] = []
      for (const entry of entries) {
        if (entry.state === 'in_progress' && entry.indeterminate) held.push(inspected({ scope: entry.bucket.scope, key: entry.key }, entry, at))
      }
      return held.sort((a, b) => a.createdAt.getTime() - b.createdAt.getTime()).slice(0, most)
    },

    async forceRelease (id: RecordId): Promise<boolean> {
      const entry = live(id.scope, id.key, now())
      if (entry === undefined || entry.state !== 'in_progress') return false
      drop(entry)
      return true
    },

    reconcile: (options: ReconcileOptions) => reconcileWith(reconcileSource, options, 'memoryStore.reconcile'),

    startReconciler: (options: ReconcilerOptions) =>
      startReconcilerWith(reconcileSource, options, 'memoryStore.startReconciler'),

    usage (): MemoryStoreUsage {
      return { records: entries.size, bytes, scopes: entries.scopes }
    },

    async close (): Promise<void> {
      closed = true
      if (timer !== null) clearInterval(timer)
      entries.clear()
      headerSets.clear()
      slabs.clear()
      bytes = 0
    }
  }
  const sync: SyncOperations = { claim, complete, release }
  Object.defineProperty(store, 'sync', { value: sync, enumerable: false })
  stores.add(store)
  return store
}

/** The store contract's rule (lib/store.ts): an in-progress record never expires while its lease is live. */
function outliveLease (entry: Entry): void {
  if (entry.expiresAt < entry.leaseUntil) entry.expiresAt = entry.leaseUntil
}

function stepsOf (entry: Entry): StepResults {
  const steps: Record<string, unknown> = {}
  if (entry.steps !== null) for (const [name, json] of entry.steps) steps[name] = JSON.parse(json)
  return steps
}

function inspected (id: RecordId, entry: Entry, at: number): InspectedRecord {
  return {
    scope: id.scope,
    key: id.key,
    state: entry.state,
    fingerprint: fingerprintOf(entry),
    indeterminate: entry.indeterminate,
    steps: stepsOf(entry),
    createdAt: new Date(entry.createdAt),
    leaseRemainingMs: entry.state === 'in_progress' ? Math.max(0, entry.leaseUntil - at) : 0,
    expiresInMs: entry.expiresAt - at,
    response: entry.state === 'completed' ? responseOf(entry) : null
  }
}

function fingerprintOf (entry: Entry): Fingerprint {
  return entry.fingerprint ?? { algorithm: entry.algorithm, digest: (entry.slab as Buffer).subarray(entry.offset, entry.offset + entry.digestLength) }
}

function responseOf (entry: Entry): StoredResponse {
  return {
    statusCode: entry.statusCode,
    // Frozen deep down (memory-packing.ts): what a caller is handed cannot change the record.
    headers: (entry.headers?.value ?? NO_HEADERS) as StoredResponse['headers'],
    body: entry.retained ? (entry.slab as Buffer).subarray(entry.offset + entry.digestLength, entry.offset + entry.length) : null
  }
}
