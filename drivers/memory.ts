import { randomUUID } from 'node:crypto'
import { fingerprintsEqual } from '../lib/fingerprint.js'
import { HeaderSets, Names } from './memory-packing.js'
import { Buckets, compactKey, type Bucket } from './memory-records.js'
import { CompletedTable, NONE, ROW_BYTES } from './memory-table.js'
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

/**
 * A record in progress: a JS object in its bucket's index (memory-pending.ts; few at a time, and
 * each carries a token, a lease, steps). Once completed, a record is a row of the table
 * (memory-table.ts) instead.
 */
interface Pending {
  /** The scope's bucket (its scope, and what the scope holds). */
  readonly bucket: Bucket<Pending>
  readonly key: string
  readonly fingerprint: Fingerprint
  token: string
  leaseUntil: number
  expiresAt: number
  /** Counted against maxBytes, and against its scope's maxBytesPerScope. */
  bytes: number
  /** Recorded step results (JSON text by name), or null before the first. */
  steps: Map<string, string> | null
  /** Held for the reconciler after an indeterminate failure; never taken over by a retry. */
  indeterminate: boolean
  readonly createdAt: number
}

/** Every memory store made, so the plugin can warn where one cannot be shared (production, a cluster worker). */
const stores = new WeakSet<object>()

export function isMemoryStore (store: unknown): boolean {
  return typeof store === 'object' && store !== null && stores.has(store)
}

/**
 * Bytes counted for a record in progress beyond its scope's and key's characters: its object (ten
 * fields), its map slot, its token.
 */
const IN_PROGRESS_OVERHEAD = 160
/**
 * Bytes counted for a completed record beyond its slab bytes (key, digest, body) and its headers:
 * its row in the table and its index slots (ROW_BYTES: 76, memory-table.ts), four times over. The
 * table doubles when full and halves once a quarter full, so a record's share of it is at most that.
 */
const COMPLETED_OVERHEAD = 4 * ROW_BYTES
const SWEEP_SLICE = 10_000
/** The default per-scope bounds are this fraction of the store's: four tenants at their share fill it. */
const SCOPE_SHARE = 4

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

  const buckets = new Buckets<Pending>()
  // Never more completed records than maxEntries: the table need not grow past it.
  const table = new CompletedTable({ maxCapacity: maxEntries })
  const headerSets = new HeaderSets()
  const algorithms = new Names()
  let bytes = 0
  let lastFullPurge = -Infinity
  let sweeping = false
  let closed = false

  const timer = purgeInterval > 0 ? setInterval(sweep, purgeInterval) : null
  timer?.unref()

  /**
   * The live record at (scope, key): in progress (its object) or completed (its id in the table).
   * An expired record found there is dropped, whichever the kind.
   */
  function recordAt (scope: string, key: string, at: number): Pending | number | undefined {
    const bucket = buckets.find(scope)
    if (bucket === undefined) return undefined
    const entry = bucket.pending.get(key)
    if (entry === undefined) {
      const id = completedAt(bucket, key, at)
      return id === NONE ? undefined : id
    }
    if (entry.expiresAt > at) return entry
    dropPending(entry)
    return undefined
  }

  /** The live record in progress at (scope, key); an expired record found there is dropped (recordAt). */
  function pendingAt (scope: string, key: string, at: number): Pending | undefined {
    const found = recordAt(scope, key, at)
    return typeof found === 'object' ? found : undefined
  }

  /** The id of the live completed record of `bucket` under `key`, or NONE; an expired one is dropped. */
  function completedAt (bucket: Bucket<Pending>, key: string, at: number): number {
    if (bucket.id < 0) return NONE
    const id = table.find(bucket.id, key)
    if (id === NONE || table.expiresAt(id) > at) return id
    dropCompleted(id)
    return NONE
  }

  function dropPending (entry: Pending): void {
    const bucket = entry.bucket
    // Not there: dropped already, so nothing it held is counted off twice.
    if (bucket.pending.get(entry.key) !== entry) return
    bucket.pending.delete(entry.key)
    count(bucket, -entry.bytes)
    buckets.removed(bucket)
  }

  function dropCompleted (id: number): void {
    const bucket = buckets.byId(table.bucketOf(id))
    count(bucket, -completedBytes(id))
    headerSets.release(table.headersOf(id))
    algorithms.release(table.algorithmOf(id))
    table.delete(id)
    buckets.removed(bucket)
  }

  /** What a completed record is counted for: the same figure when it is recorded and when it goes. */
  function completedBytes (id: number): number {
    return COMPLETED_OVERHEAD + headerSets.byId(table.headersOf(id)).bytes + table.heldBytes(id)
  }

  /** Counts `size` more bytes (fewer when negative) for a scope and the store. */
  function count (bucket: Bucket<Pending>, size: number): void {
    bucket.bytes += size
    bytes += size
  }

  /** Counts `size` more bytes (fewer when negative) for a record in progress, its scope and the store. */
  function countPending (entry: Pending, size: number): void {
    entry.bytes += size
    count(entry.bucket, size)
  }

  function owned (lease: Lease, at: number): Pending | undefined {
    const entry = pendingAt(lease.scope, lease.key, at)
    return entry !== undefined && entry.token === lease.token ? entry : undefined
  }

  /**
   * Room for one more record of `bucket`'s scope, or a MemoryStoreFullError. Four counters on the
   * hot path; a scan only when a bound is reached. No live record is ever dropped to make room (it
   * would let its operation run again): not another scope's, and not the claiming scope's own.
   */
  function makeRoom (bucket: Bucket<Pending>, at: number): void {
    if (buckets.records < maxEntries && bytes < maxBytes && bucket.records < maxEntriesPerScope && bucket.bytes < maxBytesPerScope) return
    if (buckets.records >= maxEntries || bytes >= maxBytes) {
      // A full scan at most once a second, so a store full of live records refuses quickly.
      if (at - lastFullPurge >= 1000) {
        lastFullPurge = at
        purge(Infinity, at)
      }
      if (buckets.records >= maxEntries) throw new MemoryStoreFullError(`${maxEntries} records`)
      if (bytes >= maxBytes) throw new MemoryStoreFullError(`${maxBytes} bytes`)
    }
    if (bucket.records >= maxEntriesPerScope || bucket.bytes >= maxBytesPerScope) {
      // The scope's own records only, at most once a second per scope: a tenant at its share pays
      // for scanning what it holds, and nobody else does.
      if (at - bucket.lastPurge >= 1000) {
        bucket.lastPurge = at
        if (bucket.id >= 0) for (const id of table.expiredIn(bucket.id, at)) dropCompleted(id)
        for (const entry of bucket.pending.values()) if (entry.expiresAt <= at) dropPending(entry)
      }
      if (bucket.records >= maxEntriesPerScope) throw new MemoryStoreFullError(`maxEntriesPerScope: ${maxEntriesPerScope} records`, true)
      if (bucket.bytes >= maxBytesPerScope) throw new MemoryStoreFullError(`maxBytesPerScope: ${maxBytesPerScope} bytes`, true)
    }
  }

  function purge (limit: number, at: number): number {
    let purged = 0
    // From the top row down: a deleted row is filled with one already looked at (CompletedTable.delete).
    for (let id = table.size - 1; id >= 0 && purged < limit; id--) {
      if (table.expiresAt(id) <= at) {
        dropCompleted(id)
        purged++
      }
    }
    for (const entry of buckets.pending()) {
      if (purged >= limit) break
      if (entry.expiresAt <= at) {
        dropPending(entry)
        purged++
      }
    }
    return purged
  }

  // The timer sweeps in slices, yielding to the event loop between them, so claims never wait
  // behind a scan of a large table: its rows from the top down, then the records in progress.
  // Rows go and come between slices; those below `next` are still the ones to look at
  // (CompletedTable.delete says why), and rows added meanwhile are left for the next sweep.
  function sweep (): void {
    if (sweeping || closed) return
    sweeping = true
    let next = table.size
    let inProgress: Iterator<Pending> | null = null
    const step = (): void => {
      if (closed) { sweeping = false; return }
      const at = now()
      let budget = SWEEP_SLICE
      next = Math.min(next, table.size)
      for (; next > 0 && budget > 0; budget--) {
        next--
        if (table.expiresAt(next) <= at) dropCompleted(next)
      }
      if (next === 0) {
        inProgress ??= buckets.pending()
        for (; budget > 0; budget--) {
          const item = inProgress.next()
          if (item.done === true) { sweeping = false; return }
          if (item.value.expiresAt <= at) dropPending(item.value)
        }
      }
      setImmediate(step).unref()
    }
    step()
  }

  function completedFingerprint (id: number): Fingerprint {
    return { algorithm: algorithms.name(table.algorithmOf(id)), digest: table.digest(id) }
  }

  function completedResponse (id: number): StoredResponse {
    return {
      statusCode: table.statusCode(id),
      // Frozen deep down (memory-packing.ts): what a caller is handed cannot change the record.
      headers: headerSets.byId(table.headersOf(id)).value as StoredResponse['headers'],
      body: table.body(id)
    }
  }

  function recordOf (found: Pending | number, at: number): StoredRecord {
    return typeof found === 'number'
      ? { state: 'completed', fingerprint: completedFingerprint(found), response: completedResponse(found) }
      : { state: 'in_progress', fingerprint: found.fingerprint, leaseRemainingMs: Math.max(0, found.leaseUntil - at) }
  }

  function inspected (id: RecordId, found: Pending | number, at: number): InspectedRecord {
    if (typeof found === 'object') return inspectedPending(id, found, at)
    return {
      scope: id.scope,
      key: id.key,
      state: 'completed',
      fingerprint: completedFingerprint(found),
      indeterminate: table.indeterminate(found),
      // A completed record keeps no steps: its response is what a retry gets.
      steps: {},
      createdAt: new Date(table.createdAt(found)),
      leaseRemainingMs: 0,
      expiresInMs: table.expiresAt(found) - at,
      response: completedResponse(found)
    }
  }

  const reconcileSource: ReconcileSource = {
    async findStuck (olderThanMs, limit) {
      const at = now()
      const found: Array<RecordId & { token: string }> = []
      for (const entry of buckets.pending()) {
        if (found.length >= limit) break
        if (entry.expiresAt > at && entry.leaseUntil + olderThanMs <= at) {
          found.push({ scope: entry.bucket.scope, key: entry.key, token: entry.token })
        }
      }
      return found
    },
    async acquire (candidate, olderThanMs, leaseMs) {
      const at = now()
      const entry = pendingAt(candidate.scope, candidate.key, at)
      if (entry === undefined || entry.token !== candidate.token || entry.leaseUntil + olderThanMs > at) return null
      entry.token = randomUUID()
      entry.leaseUntil = at + leaseMs
      outliveLease(entry)
      return {
        lease: { scope: candidate.scope, key: candidate.key, token: entry.token },
        fingerprint: entry.fingerprint,
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
    const bucket = buckets.bucketOf(request.scope)
    // Nothing in flight (a replay, usually): the map is not asked, so V8 does not hash a new key string only to miss.
    const entry = bucket.pending.size === 0 ? undefined : bucket.pending.get(request.key)
    if (entry !== undefined && entry.expiresAt > at) return claimInProgress(entry, request, at)
    if (entry !== undefined) {
      dropPending(entry)
    } else {
      const id = completedAt(bucket, request.key, at)
      if (id !== NONE) {
        return { outcome: 'completed', fingerprint: completedFingerprint(id), response: completedResponse(id), expiresInMs: table.expiresAt(id) - at }
      }
    }
    makeRoom(bucket, at)
    const token = randomUUID()
    const created: Pending = {
      bucket,
      key: compactKey(request.key),
      fingerprint: request.fingerprint,
      token,
      leaseUntil: at + request.leaseMs,
      expiresAt: at + request.ttlMs,
      bytes: 0,
      steps: null,
      indeterminate: false,
      createdAt: at
    }
    outliveLease(created)
    buckets.added(bucket)
    bucket.pending.set(created.key, created)
    countPending(created, IN_PROGRESS_OVERHEAD + (request.scope.length + request.key.length) * 2)
    return { outcome: 'acquired', lease: { scope: request.scope, key: request.key, token }, takeover: false }
  }

  /** A claim of a live record in progress: taken over when its lease lapsed and the request is the same, else reported. */
  function claimInProgress (entry: Pending, request: ClaimRequest, at: number): ClaimResult {
    if (entry.leaseUntil <= at && !entry.indeterminate && fingerprintsEqual(entry.fingerprint, request.fingerprint)) {
      entry.token = randomUUID()
      entry.leaseUntil = at + request.leaseMs
      // The record lives at least a ttl from now, as a newly created one would.
      entry.expiresAt = Math.max(entry.expiresAt, at + request.ttlMs)
      outliveLease(entry)
      return { outcome: 'acquired', lease: { scope: request.scope, key: request.key, token: entry.token }, takeover: true }
    }
    return { outcome: 'in_progress', fingerprint: entry.fingerprint, leaseRemainingMs: Math.max(0, entry.leaseUntil - at) }
  }

  function complete (lease: Lease, response: StoredResponse, ttlMs: number): boolean {
    const at = now()
    const entry = owned(lease, at)
    if (entry === undefined) return false
    const bucket = entry.bucket
    const headers = headerSets.intern(response.headers)
    const algorithm = algorithms.intern(entry.fingerprint.algorithm)
    const id = table.insert(bucket.id, entry.key, entry.fingerprint.digest, response, headers.id, algorithm,
      entry.indeterminate, entry.createdAt, at + ttlMs, ttlMs)
    // From the bucket's index to the table: the scope holds as many records as before. Its steps go.
    bucket.pending.delete(entry.key)
    count(bucket, completedBytes(id) - entry.bytes)
    return true
  }

  function release (lease: Lease): boolean {
    const entry = owned(lease, now())
    if (entry === undefined) return false
    dropPending(entry)
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
      const found = recordAt(id.scope, id.key, at)
      return found === undefined ? null : recordOf(found, at)
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
      countPending(entry, (name.length + resultJson.length) * 2)
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
      const found = recordAt(id.scope, id.key, at)
      return found === undefined ? null : inspected(id, found, at)
    },

    async listHeld (limit?: number): Promise<InspectedRecord[]> {
      const most = integerOption('memoryStore.listHeld(limit)', limit, 100, 1, 100_000)
      const at = now()
      const held: InspectedRecord[] = []
      for (const entry of buckets.pending()) {
        if (entry.indeterminate) held.push(inspectedPending({ scope: entry.bucket.scope, key: entry.key }, entry, at))
      }
      return held.sort((a, b) => a.createdAt.getTime() - b.createdAt.getTime()).slice(0, most)
    },

    async forceRelease (id: RecordId): Promise<boolean> {
      const entry = pendingAt(id.scope, id.key, now())
      if (entry === undefined) return false
      dropPending(entry)
      return true
    },

    reconcile: (options: ReconcileOptions) => reconcileWith(reconcileSource, options, 'memoryStore.reconcile'),

    startReconciler: (options: ReconcilerOptions) =>
      startReconcilerWith(reconcileSource, options, 'memoryStore.startReconciler'),

    usage (): MemoryStoreUsage {
      return { records: buckets.records, bytes, scopes: buckets.scopes }
    },

    async close (): Promise<void> {
      closed = true
      if (timer !== null) clearInterval(timer)
      buckets.clear()
      table.clear()
      headerSets.clear()
      algorithms.clear()
      bytes = 0
    }
  }
  const sync: SyncOperations = { claim, complete, release }
  Object.defineProperty(store, 'sync', { value: sync, enumerable: false })
  stores.add(store)
  return store
}

/** The store contract's rule (lib/store.ts): an in-progress record never expires while its lease is live. */
function outliveLease (entry: Pending): void {
  if (entry.expiresAt < entry.leaseUntil) entry.expiresAt = entry.leaseUntil
}

function stepsOf (entry: Pending): StepResults {
  const steps: Record<string, unknown> = {}
  if (entry.steps !== null) for (const [name, json] of entry.steps) steps[name] = JSON.parse(json)
  return steps
}

function inspectedPending (id: RecordId, entry: Pending, at: number): InspectedRecord {
  return {
    scope: id.scope,
    key: id.key,
    state: 'in_progress',
    fingerprint: entry.fingerprint,
    indeterminate: entry.indeterminate,
    steps: stepsOf(entry),
    createdAt: new Date(entry.createdAt),
    leaseRemainingMs: Math.max(0, entry.leaseUntil - at),
    expiresInMs: entry.expiresAt - at,
    response: null
  }
}
