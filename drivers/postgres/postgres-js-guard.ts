import { readFile } from 'node:fs'
import type { TransactionSql } from 'postgres'
import { isConnectionError, type ConnectionState } from './dropped-connection.js'

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
