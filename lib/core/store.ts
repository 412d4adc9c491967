/**
 * The storage-driver contract. The plugin talks to this interface only, never to a driver directly,
 * so a third party can write a driver by implementing it and checking it with the conformance suite
 * (`runConformance` from `fastify-idempotency/conformance`).
 *
 * Every method is scoped: a record is identified by (scope, key) and nothing a method does for one
 * scope can be observed from another (draft-ietf-httpapi-idempotency-key-header §5, composite key).
 * Times are durations in milliseconds; a driver measures them on its own clock (the database's
 * clock for a shared store, so instances with skewed clocks agree).
 *
 * Two rules about expiry bind every driver, because breaking either runs an operation twice (the
 * conformance suite checks both):
 * - an in-progress record never expires while its lease is live: whenever a lease is granted or
 *   extended (claim, takeover, renew, a reconciler's acquire), the record's expiry is moved to the
 *   lease's end if it was earlier. An owner that renews keeps its record however long it runs,
 *   even past the ttl;
 * - a record held for the reconciler (`hold`) never expires, is never reclaimed as a fresh record
 *   and never purged, until the reconciler resolves it (complete, release, resume) or an operator
 *   force-releases it: its recorded steps are what keeps a retry from repeating their effects.
 */

/** Identifies one record: the principal that owns the key, and the key itself. */
export interface RecordId {
  readonly scope: string
  readonly key: string
}

/**
 * What a request looked like, so a reused key with a different request can be told apart (draft §2.4).
 * `algorithm` names the function and its version (`canonical-v1`, `raw-v1`, `custom-v1`): two
 * fingerprints are equal only when both the algorithm and the digest are equal.
 */
export interface Fingerprint {
  readonly algorithm: string
  readonly digest: Buffer
}

/** A handler's response as recorded for replay. */
export interface StoredResponse {
  readonly statusCode: number
  /** Replayable headers only, names in lower case. */
  readonly headers: Readonly<Record<string, string | string[]>>
  /**
   * The body bytes, or `null` when it was not retained (larger than `maxResponseBytes`, or more
   * than the store's bounds could hold): the outcome is recorded (the operation must not run again)
   * but its representation was not.
   */
  readonly body: Buffer | null
}

/** Proof of ownership of an in-progress record. Drivers may return a subtype carrying their own state. */
export interface Lease extends RecordId {
  /** Random token; completion, release and renewal are fenced by it. */
  readonly token: string
}

export interface ClaimRequest extends RecordId {
  readonly fingerprint: Fingerprint
  /** How long the new owner holds the record before another attempt may take it over. */
  readonly leaseMs: number
  /** How long a record is retained after it was created or completed. */
  readonly ttlMs: number
  /**
   * Set when duplicates of this request may wait for it (the route's or the run's `wait`): a
   * driver with {@link IdempotencyStore.watchSettlements} then announces the settlement of the
   * record this claim acquires (complete, release, hold) to every watcher. A record nobody may
   * wait for is settled without a notice, which costs something (see the PostgreSQL driver).
   */
  readonly announce?: boolean
}

/** The store created the record, or took over an abandoned one: the caller now executes. */
export interface ClaimAcquired {
  readonly outcome: 'acquired'
  readonly lease: Lease
  /** True when an in-progress record whose lease had expired was taken over. */
  readonly takeover: boolean
  /**
   * Set by `claimInTransaction` only: the open transaction the handler writes through (exposed as
   * `request.idempotency.sql`). It commits in `complete` and rolls back in `release`.
   */
  readonly transaction?: unknown
}

/**
 * What `claimInTransaction` is asked: a claim. The caller waits for a key in progress itself (the
 * `wait` option), outside any transaction, so the claim never blocks on another's.
 */
export type InTransactionClaimRequest = ClaimRequest

/** Another attempt owns the record and is (or was, until its lease expires) executing. */
export interface ClaimInProgress {
  readonly outcome: 'in_progress'
  readonly fingerprint: Fingerprint
  /** Milliseconds until the owner's lease expires (0 when unknown). */
  readonly leaseRemainingMs: number
  /**
   * Set by `claimInTransaction` when the record in the way could not be read: another
   * transaction's uncommitted claim of the key. `fingerprint` is then the request's own, and
   * `leaseRemainingMs` 0: the caller waits for a settlement (or answers 409), then claims again.
   */
  readonly unseen?: boolean
}

/** The operation completed and its response was recorded. */
export interface ClaimCompleted {
  readonly outcome: 'completed'
  readonly fingerprint: Fingerprint
  readonly response: StoredResponse
  /**
   * Optional: milliseconds until the record expires. When given, a pre-filter may keep a copy for
   * at most that long; without it, a record read from the store is not copied.
   */
  readonly expiresInMs?: number
}

export type ClaimResult = ClaimAcquired | ClaimInProgress | ClaimCompleted

/**
 * Recorded results of a request's recovery points (`request.idempotency.step`), by step name: the
 * JSON value each completed step returned.
 */
export type StepResults = Readonly<Record<string, unknown>>

/** A message for the transactional outbox (`request.idempotency.enqueue`). */
export interface OutboxEntry {
  /** Unique within the operation: enqueueing a name twice keeps the first message. */
  readonly name: string
  /** Free-form routing label for the deliverer (an email provider, a queue name). */
  readonly topic: string
  /** Any JSON value. */
  readonly payload: unknown
}

/** A record as `get` returns it. */
export type StoredRecord =
  | { readonly state: 'in_progress', readonly fingerprint: Fingerprint, readonly leaseRemainingMs: number }
  | { readonly state: 'completed', readonly fingerprint: Fingerprint, readonly response: StoredResponse }

/**
 * What an operation may return: its result, or a promise of it. A store whose records live in the
 * process (the memory store) answers at once, and the plugin then goes on without a promise or a
 * timeout (nothing can hang); a store that does I/O returns a promise, which the plugin bounds by
 * `storeTimeout`. The plugin calls exactly the methods of the object it was given, whatever it is
 * (the driver's own store, or a wrapper built by spreading it or with a Proxy): there is no second,
 * hidden way in, so a wrapper that adds logging, metrics, a circuit breaker or fault injection sees
 * every call. An operation that throws counts as one that rejected.
 */
export type Answer<T> = T | Promise<T>

/** What {@link IdempotencyStore.watchSettlements} calls. */
export interface SettlementHandlers {
  /**
   * A record settled (completed, released, held for the reconciler, resolved by it, or
   * force-released) in some process sharing the store. `digest` is `settlementDigest(scope, key)`
   * (exported by `fastify-idempotency`): the record's identity, not its key, so a notice
   * shows no key to whoever else can watch.
   */
  settled (digest: string): void
  /**
   * Whether notices flow: true once the watch is in place, false when it was lost (a notice sent
   * meanwhile may never arrive) until it is in place again. Waiters poll the store while it is false.
   */
  live (flowing: boolean): void
}

export interface IdempotencyStore {
  /**
   * Decides who executes. Atomically, with respect to every other call on the same (scope, key), from
   * any process sharing the store:
   * - no record, or only an expired one (older than its ttl): create an in-progress record owned by
   *   a fresh token and return `acquired`;
   * - an in-progress record whose lease has expired and whose fingerprint equals the request's:
   *   hand it to a fresh token (the old token stops working) and return `acquired` with `takeover`;
   * - anything else: return the record's state and fingerprint, unchanged.
   * At most one concurrent caller may get `acquired` for a record. The caller compares fingerprints.
   */
  claim (request: ClaimRequest): Answer<ClaimResult>

  /**
   * Records the response and marks the record completed, retained for `ttlMs` from now. Atomic and
   * fenced: it succeeds only while `lease.token` still owns an in-progress record, and returns
   * false (changing nothing) otherwise, so an owner whose lease was taken over cannot overwrite
   * the new owner's record. A store that cannot hold the response may record it without its body
   * (`body: null`, `headers: {}`) rather than refuse: the operation ran.
   */
  complete (lease: Lease, response: StoredResponse, ttlMs: number): Answer<boolean>

  /**
   * Deletes the in-progress record so the next attempt executes again. Fenced like `complete`;
   * returns false when the token no longer owns it.
   */
  release (lease: Lease): Answer<boolean>

  /**
   * Extends the lease to `leaseMs` from now, and the record's expiry with it when it would end
   * earlier (see the rules above). Fenced like `complete`; false means ownership was lost.
   * `leaseMs` 0 gives the lease up at once: the record stays in progress, with its steps, and the
   * next attempt of the same request takes it over (how the plugin gives back a takeover whose
   * answer came too late to be used).
   */
  renew (lease: Lease, leaseMs: number): Answer<boolean>

  /** Reads a live record (never an expired one), or null. Never changes anything. */
  get (id: RecordId): Promise<StoredRecord | null>

  /**
   * Deletes up to `limit` expired records and returns how many went. It must not block concurrent
   * claims for longer than a single short statement.
   */
  purgeExpired (limit?: number): Promise<number>

  /** Stops the driver's own timers and releases what the driver opened (never a client the user passed in). */
  close (): Promise<void>

  /**
   * Optional: notices of settlements made by every process sharing the store, so a duplicate that
   * waits for its original (the `wait` option) answers when the original settles instead of
   * polling. Called once per registration (or runner), at its first wait; the returned function
   * stops the watch (the registration closed). Settlements of records claimed with `announce` must
   * be noticed; others may be. A driver that cannot watch leaves this out: waiters then poll.
   */
  watchSettlements? (handlers: SettlementHandlers): () => void

  /**
   * Optional: tells, before the first request, whether the store can serve as it is set up. The
   * plugin calls it once per registration when the app boots (Fastify's `onReady`: `ready()`,
   * `listen()`), bounded by `storeTimeout`, on the object it was given (a wrapper sees the call).
   * - Resolves: the store is ready.
   * - Rejects with `StoreNotReadyError`: it cannot serve (the PostgreSQL driver: its tables are
   *   missing, or lack columns this version needs), and the boot fails with that error, whose
   *   message says what to do (run `migrate()`). Without this, every protected request would answer
   *   503 and, with Fastify's default `logger: false`, nothing would say why.
   * - Rejects with anything else, or does not answer in time: the store could not be checked (the
   *   database is unreachable at boot). The app boots, with a `FST_IDEMPOTENCY_STORE_UNCHECKED`
   *   process warning carrying the error's message; requests answer 503 while the store fails.
   * It must be cheap (a catalog read) and change nothing.
   */
  check? (): Promise<void>

  /**
   * Optional (atomic mode, route option `transaction: true`): like `claim`, but an `acquired` record
   * is inserted inside a transaction that stays open, returned as `transaction`, so the handler's
   * writes, the claim and the recorded response commit together or not at all:
   * - `complete(lease, ...)` writes the response and commits. When the database reports that the
   *   transaction did not commit (it rolled back), it throws a `RolledBackError`; any other error
   *   means the outcome is unknown (e.g. the connection dropped after COMMIT was sent), and the
   *   plugin answers so instead of claiming a rollback;
   * - `release(lease)` rolls back, removing the claim and everything the handler wrote;
   * - the transaction handle refuses to run anything once it has ended;
   * - when the handler ended the transaction itself through the handle (COMMIT, ROLLBACK, PREPARE
   *   TRANSACTION), `complete` and `release` hold the key for the reconciler instead and reject
   *   with `TransactionEndedError`: what it wrote may have committed without the record;
   * - `renew` has nothing to do (the open transaction holds the record; a crash rolls it back).
   * A concurrent claim of the same key never blocks on the uncommitted record: it reports the key
   * in progress at once (`unseen`), so a duplicate holds a connection for no longer than its claim
   * (the plugin's `storeTimeout` bounds it). On any outcome but `acquired`, no transaction is left
   * open.
   */
  claimInTransaction? (request: InTransactionClaimRequest): Promise<ClaimResult>

  /**
   * Optional (recovery points, `request.idempotency.step`): the step results recorded on the
   * in-progress record `lease` owns, or null when the lease no longer owns it. A takeover keeps
   * them (the new owner continues from the first incomplete step); an expired record reclaimed as
   * a fresh one starts with none.
   */
  loadSteps? (lease: Lease): Promise<StepResults | null>

  /**
   * Optional: records one step's JSON result (`resultJson`, already serialized) on the record,
   * fenced like `complete`. Returns false, writing nothing, when the lease no longer owns the record
   * or the step is already recorded. It may reject when the store cannot hold the result (the
   * memory store past its bounds): the plugin treats that as a store failure after an effect,
   * never as a lost lease.
   */
  saveStep? (lease: Lease, name: string, resultJson: string): Promise<boolean>

  /**
   * Optional (transactional recovery points, `step(name, fn, { transaction: true })`): runs
   * `fn(transaction)` in a new transaction, serializes its result with `toJson`, and records the step
   * in that same transaction, fenced like `saveStep`, so the step's writes and its record commit
   * together. Returns the recorded JSON, or null when the lease no longer owns the record (then
   * everything `fn` wrote is rolled back). An error thrown by `fn` rolls back and propagates. When
   * `fn` ended the transaction itself, nothing is recorded and it rejects with
   * `TransactionEndedError` (the plugin then treats the step as having taken effect).
   */
  runStepInTransaction? (lease: Lease, name: string, fn: (transaction: unknown) => Promise<unknown>, toJson: (value: unknown) => string): Promise<string | null>

  /**
   * Optional (indeterminate failures): keeps the record in progress, with its steps, for the
   * reconciler: it is never taken over by a retry (retries get 409), never expires and is never
   * purged, until the reconciler resolves it or an operator force-releases it. Fenced like
   * `complete`; false when the lease no longer owns the record.
   */
  hold? (lease: Lease): Answer<boolean>

  /**
   * Optional (transactional outbox): inserts `message` through `transaction` (the atomic-mode
   * request's, or a transactional step's), so it exists exactly when that transaction commits.
   */
  enqueue? (transaction: unknown, message: RecordId & OutboxEntry): Promise<void>

  /**
   * Optional: called (and not awaited) after a transaction that enqueued messages for `id`
   * committed, so the driver delivers them at once; a crash before then leaves them to its worker.
   */
  afterCommit? (id: RecordId): void
}
