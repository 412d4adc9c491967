import { randomUUID } from 'node:crypto'
import { fingerprintsEqual } from '../lib/core/fingerprint.js'
import { HeaderSets, Names } from './memory-packing.js'
import { Buckets, compactKey, type Bucket } from './memory-records.js'
import { CompletedTable, heldBytesAtMost, keyBytesOf, NONE, ROW_BYTES } from './memory-table.js'
import { InvalidOptionError } from '../lib/core/errors.js'
import { integerOption, MAX_TIMER_MS } from '../lib/core/validate.js'
import type { InspectedRecord, RecoveryTools } from '../lib/core/admin.js'
import { reconcileWith, startReconcilerWith, type ReconcileOptions, type ReconcilerOptions, type ReconcileSource } from '../lib/core/reconcile.js'
import type {
  ClaimRequest, ClaimResult, Fingerprint, IdempotencyStore, Lease, RecordId, StepResults, StoredRecord, StoredResponse
} from '../lib/core/store.js'

export interface MemoryStoreOptions {
  /**
   * Most records held at once, in progress and completed; never exceeded. When it is reached (after
   * dropping expired records) new claims are refused with MemoryStoreFullError (the plugin answers
   * 503); no live record is ever dropped to make room, since its operation could then run again.
   * @defaultValue 1_000_000
   */
  maxEntries?: number
  /**
   * Approximate bytes held at once (keys, fingerprints, headers, bodies, step results and each
   * record's bookkeeping); never exceeded, at any moment. A claim counts what its record takes in
   * progress or, if more, what it takes completed without its response, so recording an outcome
   * always fits. A response that does not fit whole is recorded without its body and headers: a
   * retry gets the 410 problem "response not retained" (as for a body over `maxResponseBytes`),
   * never a second execution. A step result that does not fit is refused with MemoryStoreFullError
   * (its effect happened: the plugin holds the key for the reconciler). New claims that do not fit
   * are refused, as for `maxEntries`.
   * @defaultValue 805_306_368 (768 MiB: room for the default maxEntries of small records)
   */
  maxBytes?: number
  /**
   * The records each scope (tenant) is guaranteed, so that one tenant cannot starve the others; it
   * limits a scope only while other scopes compete for the room:
   * - a scope below its share claims whenever the store has room;
   * - a scope at its share goes on (borrows) only from room that no other scope holding records may
   *   still claim within its own share: the store keeps free, for each of them, its share minus
   *   what it holds. So one scope alone may use the whole store (an unscoped app, where every record
   *   is in the scope `''`, is never refused before `maxEntries`), and a scope holding records is
   *   never refused within its share because another scope borrowed.
   * A scope refused because it holds its share gets MemoryStoreFullError with `scoped: true`.
   * Not covered: a scope holding no records at all (a newcomer) that arrives after a borrower filled
   * the store is refused until records expire: no live record is ever dropped to make room. Keep
   * the store's bounds above what a borrower can fill in a ttl, or rate-limit each scope.
   * @defaultValue a quarter of maxEntries
   */
  maxEntriesPerScope?: number
  /**
   * The bytes each scope is guaranteed: the rule of `maxEntriesPerScope`, for bytes (claims,
   * responses and step results alike).
   * @defaultValue a quarter of maxBytes
   */
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

/**
 * The memory store: the plugin's store contract, recovery points, and the operator tools. Its
 * records live in the process, so `claim`, `complete`, `release`, `renew` and `hold` answer directly
 * (no promise), and throw where a store doing I/O would reject.
 */
export interface MemoryStore extends IdempotencyStore, RecoveryTools {
  claim (request: ClaimRequest): ClaimResult
  complete (lease: Lease, response: StoredResponse, ttlMs: number): boolean
  release (lease: Lease): boolean
  renew (lease: Lease, leaseMs: number): boolean
  hold (lease: Lease): boolean
  loadSteps (lease: Lease): Promise<StepResults | null>
  /** Rejects with MemoryStoreFullError when the result does not fit the byte bounds. */
  saveStep (lease: Lease, name: string, resultJson: string): Promise<boolean>
  /** What the store holds now (records, counted bytes, scopes): for a gauge, or an alert before it is full. */
  usage (): MemoryStoreUsage
}

/**
 * Thrown by `claim` (and by `saveStep`, for a step result) when what it would add does not fit the
 * memory store's bounds, or the rule of the scope's share (MemoryStoreOptions.maxEntriesPerScope):
 * nothing live is ever dropped to make room.
 */
export class MemoryStoreFullError extends Error {
  readonly code = 'FST_IDEMPOTENCY_MEMORY_STORE_FULL'
  /**
   * True when only this scope was refused: it holds its share, and the room left is kept for other
   * scopes holding records, up to their shares. False when the whole store is full.
   */
  readonly scoped: boolean

  constructor (limit: string, scoped = false) {
    super(scoped
      ? `fastify-idempotency: this scope holds its share of the memory store (${limit}) and the room left is kept for other scopes' shares; no unexpired record is dropped, so this scope's new records are refused until records expire (other scopes are served)`
      : `fastify-idempotency: the memory store is full (${limit}); no unexpired record is dropped, so new records are refused until records expire`)
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
  /**
   * Counted against maxBytes and its scope's share: the most of what it takes in progress and what
   * it takes completed without its response (so its completion always fits), plus its steps.
   */
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
/** The default per-scope shares are this fraction of the store's bounds: four tenants at their share fill it. */
const SCOPE_SHARE = 4
/** A full scan for expired records at most this often (ms), so a store full of live records refuses quickly. */
const PURGE_EVERY = 1000

/** What `makeRoom` answers: room, or the bound that refuses. */
const ROOM = 0
const STORE_RECORDS = 1
const STORE_BYTES = 2
const SHARE_RECORDS = 3
const SHARE_BYTES = 4
type Refusal = typeof ROOM | typeof STORE_RECORDS | typeof STORE_BYTES | typeof SHARE_RECORDS | typeof SHARE_BYTES

/** What `admits` answers. */
const FITS = 0
const OVER_CAPACITY = 1
const OVER_SHARE = 2

/** What a record completed without its response records: its status only (lib/core/store.ts, StoredResponse.body). */
const NO_HEADERS: StoredResponse['headers'] = Object.freeze({})

/**
 * The embedded default: one process, nothing to install. Every operation runs synchronously inside
 * one call, so claims are atomic with respect to each other within the process; it is not shared
 * between processes (use the Postgres driver for several instances).
 *
 * Its bounds hold for what it holds at every moment: each addition (a claim's record, a response, a
 * step result) is admitted by `makeRoom` before it is made, in the same synchronous call, so
 * concurrent requests cannot add up past them.
 */
export function memoryStore (options: MemoryStoreOptions = {}): MemoryStore {
  const maxEntries = integerOption('memoryStore option "maxEntries"', options.maxEntries, 1_000_000, 1, Number.MAX_SAFE_INTEGER)
  const maxBytes = integerOption('memoryStore option "maxBytes"', options.maxBytes, 768 * 1024 * 1024, 1, Number.MAX_SAFE_INTEGER, 'bytes')
  // With one global bound, a tenant that fills the store (768 requests of 1 MiB take seconds) has
  // every tenant answered 503 until its records expire: each scope is guaranteed a share.
  const maxEntriesPerScope = integerOption('memoryStore option "maxEntriesPerScope"', options.maxEntriesPerScope, Math.max(1, Math.floor(maxEntries / SCOPE_SHARE)), 1, Number.MAX_SAFE_INTEGER)
  const maxBytesPerScope = integerOption('memoryStore option "maxBytesPerScope"', options.maxBytesPerScope, Math.max(1, Math.floor(maxBytes / SCOPE_SHARE)), 1, Number.MAX_SAFE_INTEGER, 'bytes')
  const purgeInterval = integerOption('memoryStore option "purgeInterval"', options.purgeInterval, 60_000, 0, MAX_TIMER_MS, 'ms')
  const now = options.now ?? Date.now
  if (typeof now !== 'function') throw new InvalidOptionError('memoryStore option "now"', 'a function returning ms since the epoch', now)

  const buckets = new Buckets<Pending>(maxEntriesPerScope)
  // Never more completed records than maxEntries: the table need not grow past it.
  const table = new CompletedTable({ maxCapacity: maxEntries })
  const headerSets = new HeaderSets()
  const algorithms = new Names()
  let bytes = 0
  /** The sum over scopes of their bytes up to their share: Buckets.recordsWithinShares, for bytes. */
  let bytesWithinShares = 0
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
    const before = bucket.bytes
    bucket.bytes = before + size
    bytes += size
    bytesWithinShares += Math.min(bucket.bytes, maxBytesPerScope) - Math.min(before, maxBytesPerScope)
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
   * Whether `bucket`'s scope may add `records` records (0 or 1) and `size` bytes: ROOM, or the bound
   * that refuses. A few counters on the hot path (a scope within its share, a store with room); a
   * scan only when a bound refuses, at most once a second. No live record is ever dropped to make
   * room (it would let its operation run again): not another scope's, and not the scope's own.
   */
  function makeRoom (bucket: Bucket<Pending>, records: number, size: number, at: number): Refusal {
    if (bytes + size <= maxBytes && bucket.bytes + size <= maxBytesPerScope &&
      (records === 0 || (buckets.records + records <= maxEntries && bucket.records + records <= maxEntriesPerScope))) return ROOM
    let refused = refusalOf(bucket, records, size)
    // A scope refused at its share first sweeps its own records (it pays for scanning what it
    // holds, nobody else's); then, as a store without room, the whole store.
    if ((refused === SHARE_RECORDS || refused === SHARE_BYTES) && at - bucket.lastPurge >= PURGE_EVERY) {
      bucket.lastPurge = at
      if (bucket.id >= 0) for (const id of table.expiredIn(bucket.id, at)) dropCompleted(id)
      for (const entry of bucket.pending.values()) if (entry.expiresAt <= at) dropPending(entry)
      refused = refusalOf(bucket, records, size)
    }
    if (refused !== ROOM && at - lastFullPurge >= PURGE_EVERY) {
      lastFullPurge = at
      purge(Infinity, at)
      refused = refusalOf(bucket, records, size)
    }
    return refused
  }

  /** `makeRoom`'s answer without a sweep: records first, then bytes (see `admits`). */
  function refusalOf (bucket: Bucket<Pending>, records: number, size: number): Refusal {
    const holds = bucket.records > 0
    if (records > 0) {
      const byRecords = admits(records, bucket.records, holds, buckets.records, maxEntries, maxEntriesPerScope, buckets.recordsWithinShares, buckets.scopes)
      if (byRecords !== FITS) return byRecords === OVER_SHARE ? SHARE_RECORDS : STORE_RECORDS
    }
    const byBytes = admits(size, bucket.bytes, holds, bytes, maxBytes, maxBytesPerScope, bytesWithinShares, buckets.scopes)
    return byBytes === FITS ? ROOM : byBytes === OVER_SHARE ? SHARE_BYTES : STORE_BYTES
  }

  function fullError (refused: Refusal): MemoryStoreFullError {
    switch (refused) {
      case STORE_RECORDS: return new MemoryStoreFullError(`${maxEntries} records`)
      case STORE_BYTES: return new MemoryStoreFullError(`${maxBytes} bytes`)
      case SHARE_RECORDS: return new MemoryStoreFullError(`maxEntriesPerScope: ${maxEntriesPerScope} records`, true)
      default: return new MemoryStoreFullError(`maxBytesPerScope: ${maxBytesPerScope} bytes`, true)
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
    complete: async (lease, response, ttlMs) => complete(lease, response, ttlMs),
    release: async (lease) => release(lease),
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
    const size = Math.max(IN_PROGRESS_OVERHEAD + (request.scope.length + request.key.length) * 2,
      COMPLETED_OVERHEAD + heldBytesAtMost(keyBytesOf(request.key) + request.fingerprint.digest.length))
    const refused = makeRoom(bucket, 1, size, at)
    if (refused !== ROOM) throw fullError(refused)
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
    countPending(created, size)
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
    const digest = entry.fingerprint.digest
    let recorded = response
    let headers = headerSets.intern(response.headers)
    const size = COMPLETED_OVERHEAD + headers.bytes +
      table.heldBytesFor(keyBytesOf(entry.key) + digest.length + (response.body === null ? 0 : response.body.length), ttlMs)
    if (size > entry.bytes && makeRoom(bucket, 0, size - entry.bytes, at) !== ROOM) {
      // The operation ran: refusing its outcome would let a retry run it again. So the outcome is
      // recorded without its representation, which the claim counted room for; a retry gets the
      // 410 problem "not retained", as for a body over maxResponseBytes.
      headerSets.release(headers.id)
      recorded = { statusCode: response.statusCode, headers: NO_HEADERS, body: null }
      headers = headerSets.intern(NO_HEADERS)
    }
    const algorithm = algorithms.intern(entry.fingerprint.algorithm)
    const id = table.insert(bucket.id, entry.key, digest, recorded, headers.id, algorithm,
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

  // Answered directly, not through promises: the plugin then goes on at once (lib/core/store.ts, Answer).
  const store: MemoryStore = {
    claim,
    complete,
    release,

    // leaseMs 0 gives the lease up: the lease has ended by the next claim, which takes the record
    // over (with its steps) when it is the same request.
    renew (lease: Lease, leaseMs: number): boolean {
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
      const at = now()
      const entry = owned(lease, at)
      if (entry === undefined || entry.steps?.has(name) === true) return false
      // Refused, not recorded past the bounds: the step's effect happened, and the plugin holds the
      // key for the reconciler when its record cannot be written (never a lost lease).
      const refused = makeRoom(entry.bucket, 0, (name.length + resultJson.length) * 2, at)
      if (refused !== ROOM) throw fullError(refused)
      entry.steps ??= new Map()
      entry.steps.set(name, resultJson)
      countPending(entry, (name.length + resultJson.length) * 2)
      return true
    },

    hold (lease: Lease): boolean {
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
      bytesWithinShares = 0
    }
  }
  stores.add(store)
  return store
}

/**
 * Whether a scope holding `used` of a quantity (records or bytes; `holds`: it holds records) may
 * add `need` more, given the store's `total` of it, its `capacity`, each scope's guaranteed `share`,
 * the sum over scopes of their use up to their share (`withinShares`), and how many scopes hold
 * records (`holders`), in O(1): FITS, OVER_CAPACITY or OVER_SHARE (MemoryStoreOptions.maxEntriesPerScope):
 * - never past the capacity;
 * - within its share, whenever the store has room;
 * - past its share (borrowing), only while the room left covers what every other scope holding
 *   records may still claim within its share (`max(0, share - use)` each): their shares total
 *   `others * share`, of which they use `othersWithin`.
 * A claim that straddles the share is borrowing for its part beyond it, and the condition is then
 * the same as for all of it.
 */
function admits (need: number, used: number, holds: boolean, total: number, capacity: number, share: number, withinShares: number, holders: number): number {
  if (total + need > capacity) return OVER_CAPACITY
  if (used + need <= share) return FITS
  const others = holds ? holders - 1 : holders
  const othersWithin = holds ? withinShares - Math.min(used, share) : withinShares
  return total + need + (others * share - othersWithin) <= capacity ? FITS : OVER_SHARE
}

/** The store contract's rule (lib/core/store.ts): an in-progress record never expires while its lease is live. */
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
