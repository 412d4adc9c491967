import { randomUUID } from 'node:crypto'
import { RolledBackError, TransactionEndedError } from '../../lib/core/errors.js'
import { fingerprintsEqual } from '../../lib/core/fingerprint.js'
import type { ClaimRequest, ClaimResult, Lease, StoredResponse } from '../../lib/core/store.js'
import type { DatabaseClient, TransactionConnection } from './client.js'
import { answerFrom, createAtomicStatements, type AtomicStatements } from './statements.js'

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

const MAX_CLAIM_ROUNDS = 10

export interface Transactions {
  claimInTransaction (request: ClaimRequest): Promise<ClaimResult>
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

  function claimInTransaction (request: ClaimRequest): Promise<ClaimResult> {
    return new Promise<ClaimResult>((resolve, reject) => { attempt(request, resolve, reject) })
  }

  function attempt (request: ClaimRequest, resolveClaim: (result: ClaimResult) => void, rejectClaim: (err: unknown) => void): void {
    const token = randomUUID()
    /** The body returned with a recorded response: the client sends COMMIT from here on. */
    let commitSent = false
    /** What the claim found when it did not acquire the key: resolved once its transaction has ended. */
    let answered: ClaimResult | null = null
    /** The transaction ended under the handle: what `decide` rejects with, whatever the client reports. */
    let endedEarly: TransactionEndedError | null = null
    let decide!: (decision: Decision) => void
    const decided = new Promise<Decision>((resolve) => { decide = resolve })
    /** Resolves once the body has carried the decision out, up to what is left to the client (COMMIT, ROLLBACK). */
    let carriedOut!: () => void
    const decisionCarriedOut = new Promise<void>((resolve) => { carriedOut = resolve })
    const transaction: OpenTransaction = {
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
      const outcome = await claimWithin(tx, statements, request, token)
      if (outcome.outcome !== 'acquired') {
        // Answered once the transaction has ended: it holds the key's lock until then, and a claim
        // the caller makes next (the same request again, with the record's spelling of its
        // fingerprint, or once woken) would otherwise find the key taken by this very attempt.
        answered = outcome
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
    }, { commitSent: () => { commitSent = true }, marked: true })

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
        // The answer stands however the transaction ended: a rolled-back claim changed nothing.
        if (answered !== null) resolveClaim(answered)
        else if (err !== ROLLBACK) rejectClaim(err)
      }
    )
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
 * The claim, inside the transaction. It never waits for another transaction (statements.ts, the
 * atomic claim: the key's advisory lock, tried): a key whose lock another transaction holds is
 * reported in progress at once, so a duplicate holds this connection for one round trip, and waits
 * (the `wait` option) outside any transaction. Reclaiming an expired record or taking over a
 * lapsed one happens only with the lock got: no other atomic claim is then at the row.
 */
async function claimWithin (
  tx: TransactionConnection,
  statements: AtomicStatements,
  request: ClaimRequest,
  token: string
): Promise<ClaimResult> {
  const args = { ...request, token }
  const lease = { scope: request.scope, key: request.key, token }
  // Checked before each round trip: a connection that closed between two is not written to.
  const live = (): void => { if (tx.connection.lost !== null) throw tx.connection.lost }
  for (let round = 0; round < MAX_CLAIM_ROUNDS; round++) {
    live()
    const result = await statements.claim(args)
    if (result === null) continue
    if (result.acquired) return { outcome: 'acquired', lease, takeover: false }
    if (result.busy) {
      // Another transaction holds the key's lock. The record in the way, when it can be read, says
      // what there is (a completed one replays); it is never reclaimed or taken over under the lock.
      const seen = result.record
      if (seen !== null && !seen.expired) return answerFrom(seen)
      // An uncommitted claim of the key (or a reclaim of its expired record): its fingerprint is
      // invisible until it commits, so this one cannot tell 409 from 422; a retry after the original
      // commits gets the precise answer. A claim that committed while this statement ran may also
      // read so: answered as if this request had come first, which it did, in part.
      return { outcome: 'in_progress', fingerprint: request.fingerprint, leaseRemainingMs: 0, unseen: true }
    }
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
    return answerFrom(record)
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
