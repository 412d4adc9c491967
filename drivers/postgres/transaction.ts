import { randomUUID } from 'node:crypto'
import { readFile } from 'node:fs'
import type { TransactionSql } from 'postgres'
import { RolledBackError } from '../../lib/errors.js'
import { fingerprintsEqual } from '../../lib/fingerprint.js'
import type { ClaimRequest, ClaimResult, Lease, StoredResponse } from '../../lib/store.js'
import { beginOnLiveConnection, isConnectionError, watched, type ConnectionState } from './dropped-connection.js'
import type { PostgresClient, ResolvedNames } from './options.js'
import { createStatements, type Statements } from './statements.js'

/**
 * Atomic mode: the claim, the handler's writes (through `request.idempotency.sql`) and the recorded
 * response commit in ONE transaction, or roll back together. The seeds' "critical requirement":
 * "effect happened but record lost" and "record says done but effect lost" cannot occur, and a
 * crashed process leaves nothing behind (the server rolls its transaction back).
 *
 * The transaction is a postgres.js `sql.begin` whose callback stays pending until the plugin
 * decides: `complete` writes the response and lets it COMMIT, `release` makes it ROLLBACK. The
 * connection returns to the pool on every path (postgres.js ends the transaction when the callback
 * settles, and the plugin settles every claim it acquires: response, error, abort, timeout, hijack).
 */

type Decision = { readonly response: StoredResponse, readonly ttlMs: number } | null

interface OpenTransaction {
  /** Hands the decision to the pending transaction; resolves when it has committed or rolled back. */
  decide (decision: Decision): Promise<void>
}

/** Thrown inside the transaction to make postgres.js roll it back; never escapes this file. */
const ROLLBACK = Symbol('rollback')

/** SQLSTATE lock_not_available: lock_timeout fired while blocked on another attempt's uncommitted claim. */
const LOCK_TIMEOUT = '55P03'

const MAX_CLAIM_ROUNDS = 10

export interface Transactions {
  claimInTransaction (request: ClaimRequest & { readonly waitMs: number }): Promise<ClaimResult>
  /** True while `token` owns an open transaction of this store. */
  owns (token: string): boolean
  commit (lease: Lease, response: StoredResponse, ttlMs: number): Promise<boolean>
  rollback (lease: Lease): Promise<boolean>
  /**
   * How many transactions have not ended yet, counted until postgres.js has finished their COMMIT
   * or ROLLBACK (for tests and metrics: zero when idle means nothing leaked).
   */
  readonly size: number
}

export function createTransactions (sql: PostgresClient, names: ResolvedNames): Transactions {
  const open = new Map<string, OpenTransaction>()
  let unfinished = 0

  function claimInTransaction (request: ClaimRequest & { readonly waitMs: number }): Promise<ClaimResult> {
    const token = randomUUID()
    return new Promise<ClaimResult>((resolveClaim, rejectClaim) => {
      let acquired = false
      /** The callback returned with a recorded response: postgres.js sends COMMIT from here on. */
      let commitSent = false
      let decide!: (decision: Decision) => void
      const decided = new Promise<Decision>((resolve) => { decide = resolve })

      unfinished++
      // On a dropped connection nothing more is sent, not even the ROLLBACK (dropped-connection.ts).
      const finished = beginOnLiveConnection(sql, async (tx, connection) => {
        const statements = createStatements(tx, names)
        const outcome = await claimWithin(tx, statements, request, token, connection)
        if (outcome.outcome !== 'acquired') {
          resolveClaim(outcome)
          throw ROLLBACK
        }
        const guard = guardTransaction(tx, connection)
        acquired = true
        resolveClaim({ ...outcome, transaction: guard.sql })
        const decision = await decided
        guard.end()
        // Lost: the response is not written; COMMIT was never sent, so the client gets not-committed.
        if (decision === null || connection.lost !== null) throw ROLLBACK
        let recorded: boolean
        try {
          recorded = await watched(connection, statements.complete({ scope: request.scope, key: request.key, token }, decision.response, decision.ttlMs))
        } catch (err) {
          throw new RolledBackError('the transaction could not record its response, so it was rolled back', { cause: err })
        }
        if (!recorded) throw new RolledBackError('the transaction no longer held its record, so it was rolled back')
        commitSent = true
      })

      open.set(token, {
        decide (decision) {
          decide(decision)
          return finished.then(() => {}, (err: unknown) => {
            // A rollback that was asked for: whatever ROLLBACK itself answered, a transaction whose
            // connection failed is rolled back by the server.
            if (decision === null) return
            throw commitError(err, commitSent)
          })
        }
      })
      finished.then(
        () => { open.delete(token); unfinished-- },
        (err: unknown) => {
          open.delete(token)
          unfinished--
          if (acquired || err === ROLLBACK) return
          if ((err as { code?: unknown } | null)?.code === LOCK_TIMEOUT) {
            // Blocked for `waitMs` on an uncommitted claim of the same key: in progress. Its
            // fingerprint is invisible until it commits, so this one cannot tell 409 from 422;
            // a retry after the original commits gets the precise answer.
            resolveClaim({ outcome: 'in_progress', fingerprint: request.fingerprint, leaseRemainingMs: 0 })
          } else {
            rejectClaim(err)
          }
        }
      )
    })
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
 * then says so instead of claiming a rollback (lib/store.ts, claimInTransaction).
 */
function commitError (err: unknown, commitSent: boolean): unknown {
  if (err instanceof RolledBackError) return err
  if (!commitSent || (err as { name?: unknown } | null)?.name === 'PostgresError') {
    return new RolledBackError('the transaction was rolled back instead of committed', { cause: err })
  }
  return err
}

/**
 * The claim, inside the transaction. `lock_timeout` bounds how long it blocks on another attempt's
 * uncommitted claim of the same key (the `wait` option; 0 would mean "forever" to PostgreSQL, so
 * the floor is 1 ms), and is reset right after so the handler's own statements are not affected.
 * The three statements are pipelined: one round trip.
 */
async function claimWithin (
  tx: TransactionSql<any>,
  statements: Statements,
  request: ClaimRequest & { readonly waitMs: number },
  token: string,
  connection: ConnectionState
): Promise<ClaimResult> {
  const args = { ...request, token }
  const lease = { scope: request.scope, key: request.key, token }
  const setLockTimeout = lockTimeoutStatement(request.waitMs)
  // Checked before each round trip: a connection that closed between two is not written to.
  const live = (): void => { if (connection.lost !== null) throw connection.lost }
  for (let round = 0; round < MAX_CLAIM_ROUNDS; round++) {
    live()
    // postgres.js sends a query when it is first awaited: execute() puts this one on the wire
    // before the claim (whose async function sends its statement as soon as it is called).
    const setTimeoutQuery = tx.unsafe(setLockTimeout).execute()
    const [, result] = await watched(connection, Promise.all([
      setTimeoutQuery,
      statements.claim(args),
      tx`set local lock_timeout to default`
    ]))
    if (result === null) continue
    if (result.acquired) return { outcome: 'acquired', lease, takeover: false }
    const record = result.record
    if (record.expired) {
      live()
      if (await watched(connection, statements.reclaim(args, record.token))) return { outcome: 'acquired', lease, takeover: false }
      continue
    }
    if (record.state === 'in_progress' && record.lapsed && fingerprintsEqual(record.fingerprint, request.fingerprint)) {
      live()
      if (await watched(connection, statements.takeover(args, record.token))) return { outcome: 'acquired', lease, takeover: true }
      continue
    }
    return record.state === 'completed' && record.response !== null
      ? { outcome: 'completed', fingerprint: record.fingerprint, response: record.response, expiresInMs: record.expiresInMs }
      : { outcome: 'in_progress', fingerprint: record.fingerprint, leaseRemainingMs: record.leaseRemainingMs }
  }
  throw new Error(`fastify-idempotency: the postgres store could not settle a claim in ${MAX_CLAIM_ROUNDS} rounds`)
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

/**
 * postgres.js keeps running queries on a transaction handle after its transaction ended, on the
 * connection the transaction used, which by then is back in the pool: a handler still writing after
 * a rollback (its client went away) would commit those writes outside any transaction, or inside
 * another request's. The handle given to the handler refuses every query once the transaction
 * ended, checked when the query is SENT (postgres.js sends a query when it is first awaited, so a
 * query built before the end and awaited after is refused too), and the same holds for the handles
 * of its savepoints (`sql.savepoint(fn)`) and for `sql.file()`.
 *
 * It also refuses every query once the transaction's connection is lost (`connection`), since
 * postgres.js would write it to the closed socket and crash the process (dropped-connection.ts):
 * a query failing with a connection error marks the connection lost before the code awaiting it
 * resumes (the guard watches each query from its creation, so its reaction runs first), and the
 * queries sent and not yet answered are refused at that moment (postgres.js never answers one it
 * had queued behind a statement in flight).
 */
export function guardTransaction (tx: TransactionSql<any>, connection: ConnectionState = connectionUnwatched()): { sql: TransactionSql<any>, end: () => void } {
  const transaction: Guarded = { ended: false, connection, unanswered: new Set() }
  connection.onLost((err) => {
    for (const query of transaction.unanswered) query.reject(lostError(err))
    transaction.unanswered.clear()
  })
  return { sql: guardHandle(tx, transaction), end: () => { transaction.ended = true } }
}

interface Guarded {
  ended: boolean
  readonly connection: ConnectionState
  /** Queries sent and not yet settled. */
  readonly unanswered: Set<PendingQuery>
}

/** For a caller that does not track its connection: never lost, so the guard only fences the end. */
function connectionUnwatched (): ConnectionState {
  return { lost: null, lose: () => {}, onLost: () => {} }
}

/** The parts of a postgres.js Query the guard uses (src/query.js). */
interface PendingQuery extends Promise<unknown> {
  handler: ((query: PendingQuery) => unknown) & { debug?: unknown }
  strings: readonly string[]
  reject (error: unknown): void
}

const endedError = (): Error => new Error("fastify-idempotency: this request's transaction has ended (committed or rolled back); run no more queries through request.idempotency.sql")

/** The code postgres.js gives a query on a closed connection, so a handler's own checks still match. */
const lostError = (cause: unknown): Error => Object.assign(
  new Error("fastify-idempotency: the connection of this request's transaction closed, so PostgreSQL rolled the transaction back; nothing more is sent through request.idempotency.sql", { cause }),
  { code: 'CONNECTION_CLOSED' }
)

/** Why a query may not be sent now, or null. */
function refusal (transaction: Guarded): Error | null {
  if (transaction.ended) return endedError()
  const lost = transaction.connection.lost
  return lost === null ? null : lostError(lost)
}

function guardHandle (handle: TransactionSql<any>, transaction: Guarded): TransactionSql<any> {
  const check = (): void => {
    const refused = refusal(transaction)
    if (refused !== null) throw refused
  }
  return new Proxy(handle, {
    apply (target, thisArg, args) {
      check()
      return fenced(Reflect.apply(target as unknown as (...a: unknown[]) => unknown, thisArg, args), transaction)
    },
    get (target, property, receiver) {
      const value: unknown = Reflect.get(target, property, receiver)
      if (typeof value !== 'function') return value
      const method = value as (...a: unknown[]) => unknown
      if (property === 'savepoint') return (...args: unknown[]) => { check(); return savepoint(target, method, args, transaction) }
      if (property === 'file') return (...args: unknown[]) => { check(); return fencedFile(target, method.apply(target, args) as PendingQuery, String(args[0]), transaction) }
      if (property === 'notify') {
        return () => { throw new Error('fastify-idempotency: notify() on request.idempotency.sql runs on another connection, outside the transaction (postgres.js); use sql`select pg_notify(${channel}, ${payload})` so it is sent when the transaction commits') }
      }
      return (...args: unknown[]) => { check(); return fenced(method.apply(target, args), transaction) }
    }
  })
}

/**
 * `sql.savepoint(fn)`: the savepoint's own handle is guarded by the same transaction. When `fn`
 * fails because the connection is lost, postgres.js would send ROLLBACK TO SAVEPOINT on it: `fn`'s
 * promise is left pending instead (as the transaction's callback is), and the handler gets the
 * error from the promise returned here.
 */
function savepoint (target: TransactionSql<any>, method: (...a: unknown[]) => unknown, args: unknown[], transaction: Guarded): Promise<unknown> {
  return new Promise((resolve, reject) => {
    const guarded = args.map((arg) => typeof arg !== 'function' ? arg : async (handle: TransactionSql<any>) => {
      try {
        const result = (arg as (sql: TransactionSql<any>) => unknown)(guardHandle(handle, transaction))
        return await (Array.isArray(result) ? Promise.all(result) : result)
      } catch (err) {
        // Lost: noted by the guard when one of the savepoint's queries failed with it (an error of
        // `fn`'s own, such as a fetch's ECONNRESET, says nothing of this connection).
        if (transaction.connection.lost === null) throw err
        reject(err)
        return await new Promise<never>(() => {})
      }
    })
    ;(method.apply(target, guarded) as Promise<unknown>).then(resolve, reject)
  })
}

function isQuery (value: unknown): value is PendingQuery {
  return value instanceof Promise && typeof (value as Partial<PendingQuery>).handler === 'function' && 'strings' in value
}

/**
 * A query is sent through its `handler`: the fenced one refuses it once the transaction ended or
 * its connection was lost. Watched from here with the plain Promise `then` (a query's own `then`
 * would send it): a connection error marks the connection lost before anyone else reacts to it.
 */
function fenced<T> (value: T, transaction: Guarded): T {
  if (!isQuery(value)) return value
  const query = value
  Promise.prototype.then.call(query, () => { transaction.unanswered.delete(query) }, (err: unknown) => {
    transaction.unanswered.delete(query)
    if (isConnectionError(err)) transaction.connection.lose(err)
  })
  const send = query.handler
  const guarded = (pending: PendingQuery): unknown => {
    const refused = refusal(transaction)
    if (refused !== null) return pending.reject(refused)
    transaction.unanswered.add(pending)
    return send(pending)
  }
  query.handler = Object.assign(guarded, { debug: send.debug })
  return value
}

/**
 * `sql.file()` reads the file first and then sends the query itself, past its own `handler`: read
 * here instead, and send through the transaction's handler (a tagged query's) after a last check.
 */
function fencedFile (handle: TransactionSql<any>, query: PendingQuery, path: string, transaction: Guarded): PendingQuery {
  const probe = (handle as unknown as (strings: TemplateStringsArray) => PendingQuery)(Object.assign([''], { raw: [''] }) as unknown as TemplateStringsArray)
  const send = probe.handler
  const refuse = (pending: PendingQuery): boolean => {
    const refused = refusal(transaction)
    if (refused !== null) pending.reject(refused)
    return refused !== null
  }
  const read = (pending: PendingQuery): void => {
    if (refuse(pending)) return
    readFile(path, 'utf8', (err, text) => {
      if (err !== null) return pending.reject(err)
      pending.strings = [text]
      if (refuse(pending)) return
      transaction.unanswered.add(pending)
      send(pending)
    })
  }
  Promise.prototype.then.call(query, () => { transaction.unanswered.delete(query) }, (err: unknown) => {
    transaction.unanswered.delete(query)
    if (isConnectionError(err)) transaction.connection.lose(err)
  })
  query.handler = Object.assign(read, { debug: send.debug })
  return query
}
