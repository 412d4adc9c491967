import { randomUUID } from 'node:crypto'
import diagnostics from 'node:diagnostics_channel'
import { RolledBackError, TransactionEndedError } from '../../lib/core/errors.js'
import { fingerprintsEqual } from '../../lib/core/fingerprint.js'
import type { ClaimRequest, ClaimResult, InTransactionClaimRequest, Lease, StoredResponse } from '../../lib/core/store.js'
import type { DatabaseClient, TransactionConnection } from './client.js'
import { createAtomicStatements, type AtomicStatements } from './statements.js'

/**
 * Atomic mode: the claim, the handler's writes (through `request.idempotency.sql`) and the recorded
 * response commit in ONE transaction, or roll back together: "the effect happened but its record
 * was lost" and "the record says done but the effect was lost" cannot occur, and a crashed process
 * leaves nothing behind (the server rolls its transaction back).
 *
 * The transaction is the client's (client.ts, `transaction`), whose body stays pending until the
 * plugin decides: `complete` writes the response and lets it COMMIT, `release` makes it ROLLBACK.
 * The connection returns to the pool on every path (the transaction ends when the body settles,
 * and the plugin settles every claim it acquires: response, error, abort, timeout, hijack).
 *
 * The handler could end the transaction itself, through its handle (a COMMIT, ROLLBACK or PREPARE
 * TRANSACTION, however written): its writes and the claim would then commit without the recorded
 * response, and a retry would run the operation again. The handle refuses everything after such a
 * statement and reports it (client.ts, Guard); at the decision the store then fails closed:
 * nothing is recorded, the key is held for the reconciler (holdAfterEnd), and `complete` and
 * `release` reject with TransactionEndedError. And since the statements of this mode write the
 * claim already held (statements.ts, AtomicStatements), a claim committed early is held even if
 * nothing runs after that COMMIT.
 */

type Decision = { readonly response: StoredResponse, readonly ttlMs: number } | null

interface OpenTransaction {
  readonly scope: string
  readonly key: string
  /** Whether its claim has acquired the key (until then, it may be waiting on another's). */
  holdsKey: boolean
  /** Hands the decision to the pending transaction; resolves when it has committed or rolled back. */
  decide (decision: Decision): Promise<void>
}

/** Thrown inside the transaction to make the client roll it back; never escapes this file. */
const ROLLBACK = Symbol('rollback')

/**
 * What bounds the hold's wait on a lock (holdAfterEnd): a transaction the handler prepared
 * (PREPARE TRANSACTION) keeps the record locked until someone commits or rolls it back, and the
 * request must not wait for that; another statement on the record (the reconciler's) holds it for
 * a moment only.
 */
const HOLD_LOCK_TIMEOUT = 'set local lock_timeout = 1000'

/** SQLSTATE lock_not_available: lock_timeout fired while the claim waited on a lock. */
const LOCK_TIMEOUT = '55P03'

/**
 * lock_timeout bounds every lock the claim waits on, not only another attempt's uncommitted row,
 * and PostgreSQL does not say which one it was: the table's (or an index's) extension lock, held by
 * a concurrent insert while it adds a page (for as long as that insert takes to find a buffer,
 * which on a busy machine can mean writing out a dirty one and flushing WAL first), or a DDL
 * statement's lock queued on the table. So a timed-out claim is not taken for a duplicate on that
 * word alone:
 * - When a transaction of this store holds the key, it is one: answered at once.
 * - Otherwise, when the bound is shorter than MOMENTARY_LOCK_MS (without `wait` it is 1 ms), the
 *   claim is tried once more, in a new transaction bounded by MOMENTARY_LOCK_MS. A duplicate in
 *   flight elsewhere is still there then (or has committed, and is replayed); a momentary lock has
 *   gone. A second try with the same 1 ms bound is not enough: on a busy machine a claim can time
 *   out twice on a lock that is not a duplicate's.
 * A longer bound already outlasts such a moment, and is not tried again.
 */
const LOCK_TIMEOUT_RETRIES = 1
const MOMENTARY_LOCK_MS = 100
const RETRY_LOCK_TIMEOUT = lockTimeoutStatement(MOMENTARY_LOCK_MS)

const MAX_CLAIM_ROUNDS = 10

/** What the diagnostics channel `fastify-idempotency:lock-timeout` publishes, once per timed-out claim. */
export interface LockTimeoutEvent {
  readonly scope: string
  readonly key: string
  /** The bound that fired, ms: the route's `wait` (at least 1) on a first try, MOMENTARY_LOCK_MS on the second. */
  readonly boundMs: number
  /** `retry`: tried once more; `in_progress`: answered 409 (held by this store, or still held after the longer try). */
  readonly then: 'retry' | 'in_progress'
  /** Whether a transaction of this store held the key (a duplicate here, answered without a second try). */
  readonly heldHere: boolean
}

/**
 * Atomic mode's lock waits, as an operational signal (docs/observability.md): a claim that timed
 * out, and what came of it. Many `retry` events mean claims wait on locks that are not duplicates'
 * (extension locks of a busy table, DDL); many `in_progress` ones, duplicates arriving while their
 * original still runs. Published only on the timeout path, and only built when someone subscribes.
 */
export const LOCK_TIMEOUT_CHANNEL = 'fastify-idempotency:lock-timeout'
const lockTimeouts = diagnostics.channel(LOCK_TIMEOUT_CHANNEL)

export interface Transactions {
  claimInTransaction (request: InTransactionClaimRequest): Promise<ClaimResult>
  /** True while `token` owns an open transaction of this store. */
  owns (token: string): boolean
  commit (lease: Lease, response: StoredResponse, ttlMs: number): Promise<boolean>
  rollback (lease: Lease): Promise<boolean>
  /**
   * How many transactions have not ended yet, counted until the client has finished their COMMIT
   * or ROLLBACK (for tests and metrics: zero when idle means nothing leaked).
   */
  readonly size: number
}

/** `table`: the quoted, schema-qualified name of the records table. */
export function createTransactions (db: DatabaseClient, table: string): Transactions {
  const open = new Map<string, OpenTransaction>()
  let unfinished = 0

  function claimInTransaction (request: InTransactionClaimRequest): Promise<ClaimResult> {
    return new Promise<ClaimResult>((resolve, reject) => {
      // Thrown here, an invalid waitMs rejects the claim.
      const setLockTimeout = lockTimeoutStatement(request.waitMs)
      // A caller that waits by itself (answerAtOnce) claims again later, holding no connection meanwhile.
      const retries = request.answerAtOnce !== true && request.waitMs < MOMENTARY_LOCK_MS ? LOCK_TIMEOUT_RETRIES : 0
      attempt(request, setLockTimeout, request.waitMs, retries, resolve, reject)
    })
  }

  function attempt (
    request: InTransactionClaimRequest,
    setLockTimeout: string,
    boundMs: number,
    retriesLeft: number,
    resolveClaim: (result: ClaimResult) => void,
    rejectClaim: (err: unknown) => void
  ): void {
    const token = randomUUID()
    /** The body returned with a recorded response: the client sends COMMIT from here on. */
    let commitSent = false
    /** The transaction ended under the handle: what `decide` rejects with, whatever the client reports. */
    let endedEarly: TransactionEndedError | null = null
    let decide!: (decision: Decision) => void
    const decided = new Promise<Decision>((resolve) => { decide = resolve })
    /** Resolves once the body has carried the decision out, up to what is left to the client (COMMIT, ROLLBACK). */
    let carriedOut!: () => void
    const decisionCarriedOut = new Promise<void>((resolve) => { carriedOut = resolve })
    const transaction: OpenTransaction = {
      scope: request.scope,
      key: request.key,
      holdsKey: false,
      decide (decision) {
        decide(decision)
        // The body first: the client's transaction may have failed before the decision (its
        // connection closed while the handler ran), and the body still checks the handle's
        // queries then, which may have ended the transaction, and holds the key if they did.
        return decisionCarriedOut.then(async () => {
          if (endedEarly !== null) throw endedEarly
          try {
            await finished
          } catch (err) {
            // A rollback that was asked for: whatever ROLLBACK itself answered, a transaction whose
            // connection failed is rolled back by the server.
            if (decision === null) return
            throw commitError(err, commitSent, db)
          }
        })
      }
    }

    unfinished++
    // On a dropped connection nothing more is sent, not even the ROLLBACK (dropped-connection.ts).
    const finished = db.transaction(async (tx) => {
      const statements = createAtomicStatements(tx, table)
      const outcome = await claimWithin(tx, statements, request, token, setLockTimeout)
      if (outcome.outcome !== 'acquired') {
        resolveClaim(outcome)
        throw ROLLBACK
      }
      const guard = tx.guarded()
      transaction.holdsKey = true
      resolveClaim({ ...outcome, transaction: guard.handle })
      const decision = await decided
      try {
        // Whichever the decision, the handle's queries still in flight are answered and checked
        // first: one of them may have ended the transaction.
        const early = await guard.end()
        if (early !== null) {
          const claim = { ...request, token }
          // Released: nothing more may be sent through this transaction (its client sends no
          // ROLLBACK either, client.ts, Ended); the key is held from another connection.
          endedEarly = early.released
            ? await held(early.reason, () => holdElsewhere(db, table, claim))
            : tx.connection.lost !== null
              ? new TransactionEndedError(false, { cause: tx.connection.lost })
              : await held(early.reason, () => holdAfterEnd(tx, statements, claim))
          throw ROLLBACK
        }
        // Lost: the response is not written; COMMIT was never sent, so the client gets not-committed.
        if (decision === null || tx.connection.lost !== null) throw ROLLBACK
        let recorded: boolean
        try {
          recorded = await statements.complete({ scope: request.scope, key: request.key, token }, decision.response, decision.ttlMs)
        } catch (err) {
          throw new RolledBackError('the transaction could not record its response, so it was rolled back', { cause: err })
        }
        if (!recorded) throw new RolledBackError('the transaction no longer held its record, so it was rolled back')
      } finally {
        carriedOut()
      }
    }, { commitSent: () => { commitSent = true }, prelude: setLockTimeout })

    open.set(token, transaction)
    finished.then(
      () => { open.delete(token); unfinished-- },
      (err: unknown) => {
        unfinished--
        // Still the plugin's to decide (settle takes it out): until then, `complete` and `release`
        // must come here, not to lease mode's statements, which would complete or delete a claim
        // the handler's COMMIT made durable before the connection closed.
        if (transaction.holdsKey) return
        open.delete(token)
        if (err === ROLLBACK) return
        if ((err as { code?: unknown } | null)?.code !== LOCK_TIMEOUT) return rejectClaim(err)
        const held = heldHere(request)
        const retry = retriesLeft > 0 && !held
        if (lockTimeouts.hasSubscribers) {
          const event: LockTimeoutEvent = { scope: request.scope, key: request.key, boundMs: Math.max(1, Math.ceil(boundMs)), then: retry ? 'retry' : 'in_progress', heldHere: held }
          lockTimeouts.publish(event)
        }
        if (retry) {
          attempt(request, RETRY_LOCK_TIMEOUT, MOMENTARY_LOCK_MS, retriesLeft - 1, resolveClaim, rejectClaim)
        } else {
          // Blocked on an uncommitted claim of the same key (this store's, or still there after
          // the longer try): in progress. Its fingerprint is invisible until it commits, so this
          // one cannot tell 409 from 422; a retry after the original commits gets the precise answer.
          resolveClaim(request.answerAtOnce === true && !held
            ? { outcome: 'in_progress', fingerprint: request.fingerprint, leaseRemainingMs: 0, unseen: true }
            : { outcome: 'in_progress', fingerprint: request.fingerprint, leaseRemainingMs: 0 })
        }
      }
    )
  }

  /**
   * Whether one of this store's transactions holds the key. A scan, on the lock-timeout path only:
   * the map holds one entry per transaction in flight, no more than the pool's connections.
   */
  function heldHere (request: ClaimRequest): boolean {
    for (const transaction of open.values()) {
      if (transaction.holdsKey && transaction.key === request.key && transaction.scope === request.scope) return true
    }
    return false
  }

  async function settle (lease: Lease, decision: Decision): Promise<boolean> {
    const transaction = open.get(lease.token)
    if (transaction === undefined) return false
    open.delete(lease.token)
    await transaction.decide(decision)
    return true
  }

  return {
    claimInTransaction,
    owns: (token) => open.has(token),
    commit: (lease, response, ttlMs) => settle(lease, { response, ttlMs }),
    rollback: (lease) => settle(lease, null),
    get size () { return unfinished }
  }
}

/**
 * What a failed commit means. Before COMMIT was sent (the record could not be written, the
 * connection had died), nothing committed. After it, an error the server sent (a deferred
 * constraint, a serialization failure) is a rollback too; anything else (the connection dropped
 * while COMMIT was in flight) leaves the outcome unknown, and is passed on as it is: the plugin
 * then says so instead of claiming a rollback (lib/core/store.ts, claimInTransaction).
 */
function commitError (err: unknown, commitSent: boolean, db: DatabaseClient): unknown {
  if (err instanceof RolledBackError) return err
  if (!commitSent || db.isServerError(err)) {
    return new RolledBackError('the transaction was rolled back instead of committed', { cause: err })
  }
  return err
}

/**
 * The claim, inside the transaction. `lock_timeout` bounds how long it blocks on another attempt's
 * uncommitted claim of the same key (the `wait` option; 0 would mean "forever" to PostgreSQL, so
 * the floor is 1 ms), and is reset right after so the handler's own statements are not affected.
 * The three statements are pipelined where the client pipelines (postgres.js: one round trip).
 */
async function claimWithin (
  tx: TransactionConnection,
  statements: AtomicStatements,
  request: InTransactionClaimRequest,
  token: string,
  setLockTimeout: string
): Promise<ClaimResult> {
  const args = { ...request, token }
  const lease = { scope: request.scope, key: request.key, token }
  // Checked before each round trip: a connection that closed between two is not written to.
  const live = (): void => { if (tx.connection.lost !== null) throw tx.connection.lost }
  for (let round = 0; round < MAX_CLAIM_ROUNDS; round++) {
    live()
    const result = await tx.around(setLockTimeout, () => statements.claim(args), 'set local lock_timeout to default')
    if (result === null) continue
    if (result.acquired) return { outcome: 'acquired', lease, takeover: false }
    const record = result.record
    if (record.expired) {
      live()
      if (await statements.reclaim(args, record.token)) return { outcome: 'acquired', lease, takeover: false }
      continue
    }
    if (record.state === 'in_progress' && record.lapsed && fingerprintsEqual(record.fingerprint, request.fingerprint)) {
      live()
      if (await statements.takeover(args, record.token)) return { outcome: 'acquired', lease, takeover: true }
      continue
    }
    return record.state === 'completed' && record.response !== null
      ? { outcome: 'completed', fingerprint: record.fingerprint, response: record.response, expiresInMs: record.expiresInMs }
      : { outcome: 'in_progress', fingerprint: record.fingerprint, leaseRemainingMs: record.leaseRemainingMs }
  }
  throw new Error(`fastify-idempotency: the postgres store could not settle a claim in ${MAX_CLAIM_ROUNDS} rounds`)
}

/** What `complete` and `release` reject with once the transaction ended under the handler: the hold's outcome. */
async function held (reason: Error, hold: () => Promise<boolean>): Promise<TransactionEndedError> {
  try {
    return new TransactionEndedError(await hold(), { cause: reason })
  } catch (err) {
    return new TransactionEndedError(false, { cause: new AggregateError([reason, err], 'fastify-idempotency: the transaction was ended through request.idempotency.sql, and the key could not be held') })
  }
}

/**
 * The transaction ended under the handler: its writes, and the claim with them, may have committed
 * without a recorded response (or, after a PREPARE TRANSACTION, may still), so the key is held for
 * the reconciler instead: never released, never taken over by a retry (409), never purged, until
 * the reconciler resolves it. The claim's record is held when it is there (committed by the
 * handler; in a prepared transaction, the wait for its lock times out and this throws); when it is
 * not (the handler rolled it back), a held record is inserted, unless another attempt has claimed
 * the key meanwhile: then false, nothing is held, and that attempt owns the key.
 *
 * Written on the transaction's own connection, which is no longer in the claim's transaction, as a
 * short transaction of its own: ROLLBACK first (after COMMIT AND CHAIN or ROLLBACK AND CHAIN the
 * connection is already in a new transaction; otherwise it is only a warning), then BEGIN, its
 * waits bounded by HOLD_LOCK_TIMEOUT, and its own COMMIT rather than the client's (postgres.js
 * sends ROLLBACK in place of COMMIT when one of the handle's queries had failed). A BEGIN follows
 * that COMMIT in the same text, so the session never reports itself idle (postgres.js would take
 * the connection back: client.ts, Ended), and the client's ROLLBACK then ends an empty transaction.
 */
async function holdAfterEnd (tx: TransactionConnection, statements: AtomicStatements, claim: ClaimRequest & { readonly token: string }): Promise<boolean> {
  await tx.simple(`ROLLBACK; BEGIN; ${HOLD_LOCK_TIMEOUT}`)
  const held = await statements.holdOwned(claim) || await statements.insertHeld(claim)
  await tx.simple('COMMIT; BEGIN')
  return held
}

/**
 * holdAfterEnd, in a transaction of the client's own on another connection: for when the client has
 * already taken the transaction's connection back (client.ts, Ended).
 */
async function holdElsewhere (db: DatabaseClient, table: string, claim: ClaimRequest & { readonly token: string }): Promise<boolean> {
  return await db.transaction(async (tx) => {
    await tx.simple(HOLD_LOCK_TIMEOUT)
    const statements = createAtomicStatements(tx, table)
    return await statements.holdOwned(claim) || await statements.insertHeld(claim)
  })
}

/**
 * `SET LOCAL`, not `set_config(…, true)`: the same setting on plain PostgreSQL, but Citus forwards
 * SET LOCAL commands to the workers holding the row (with `citus.propagate_set_commands = 'local'`)
 * and never a function call, so there the bound would not reach the lock it is meant to bound.
 * SET takes no bind parameters: the value is written into the text, hence an integer checked here.
 */
function lockTimeoutStatement (waitMs: number): string {
  if (typeof waitMs !== 'number' || Number.isNaN(waitMs) || waitMs < 0) {
    throw new TypeError(`fastify-idempotency: claimInTransaction needs waitMs to be a number of milliseconds >= 0, received ${String(waitMs)}`)
  }
  // 0 would mean "wait forever" to PostgreSQL; the setting is an int4 of milliseconds.
  return `set local lock_timeout = ${Math.min(2_147_483_647, Math.max(1, Math.ceil(waitMs)))}`
}
