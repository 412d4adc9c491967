import type { ConnectionState } from './dropped-connection.js'
import type { NodePostgresPoolClient } from './node-postgres.js'

/**
 * The PoolClient given to the application in atomic mode (`request.idempotency.sql`) and to a
 * transactional step. It is the transaction's client, so the handler's queries (its own, or an
 * ORM's on top of it) commit or roll back with the recorded response. What it refuses:
 *
 * - every query once the transaction ended: by then the client is back in the pool, and a handler
 *   still writing (its client went away, an answer was sent on a timeout) would write outside any
 *   transaction, or inside another request's;
 * - every query once the connection was lost (node-postgres would fail them anyway; refusing them
 *   with the same code as postgres.js gives a handler one thing to check for);
 * - `release()`: the store returns the client to the pool when the transaction ends, and a client
 *   released twice is an error in node-postgres;
 * - a statement that begins or ends a transaction (BEGIN, COMMIT, ROLLBACK, ...; see
 *   {@link endsTransaction}). Inside a transaction PostgreSQL answers BEGIN with a warning only, so an
 *   ORM's own `transaction()` on this client (Drizzle's, Kysely's: BEGIN, the writes, COMMIT) would
 *   COMMIT the claim and the handler's writes before the response is recorded: a handler that
 *   threw afterwards left its writes and a claim in progress behind, and a retry ran the operation
 *   again once the lease lapsed (test/orm-recipes.test.ts). Savepoints stay allowed.
 *
 * node-postgres sends a query when `query()` is called, so checking at the call is checking at
 * the send. Every other property is the client's own.
 */
export function guardPoolClient (
  client: NodePostgresPoolClient,
  connection: ConnectionState,
  isConnectionError: (err: unknown) => boolean
): { readonly handle: object, end (): void } {
  let ended = false

  function refusal (): Error | null {
    if (ended) return endedError()
    return connection.lost === null ? null : lostError(connection.lost)
  }

  const query = (...args: unknown[]): unknown => {
    const refused = refusal() ?? (endsTransaction(queryText(args[0])) ? transactionControlError() : null)
    if (refused !== null) return refuse(refused, args)
    const last = args[args.length - 1]
    if (typeof last === 'function') {
      // Callback style: note a connection error before the callback sees it.
      args[args.length - 1] = (err: unknown, ...rest: unknown[]) => {
        if (isConnectionError(err)) connection.lose(err)
        return (last as (...a: unknown[]) => unknown)(err, ...rest)
      }
    }
    const sent = (client.query as (...a: unknown[]) => unknown).apply(client, args)
    if (sent instanceof Promise) {
      // Watched, not replaced: the caller gets node-postgres's own promise and its error.
      sent.catch((err: unknown) => { if (isConnectionError(err)) connection.lose(err) })
    }
    return sent
  }

  const release = (): never => {
    throw new Error("fastify-idempotency: request.idempotency.sql is the request's transaction; the store releases it when the transaction ends")
  }

  const handle = new Proxy(client as object, {
    get (target, property) {
      if (property === 'query') return query
      if (property === 'release') return release
      const value: unknown = Reflect.get(target, property, target)
      return typeof value === 'function' ? (value as (...a: unknown[]) => unknown).bind(target) : value
    }
  })
  return { handle, end: () => { ended = true } }
}

/** The text of a query as `client.query` takes it: a string, a config `{ text }`, or a submittable (pg-cursor, pg-query-stream). */
function queryText (first: unknown): string {
  if (typeof first === 'string') return first
  const text = (first as { text?: unknown } | null)?.text
  return typeof text === 'string' ? text : ''
}

/**
 * True for a statement that starts or ends a transaction block: BEGIN, START TRANSACTION, COMMIT,
 * END, ROLLBACK (not ROLLBACK TO SAVEPOINT), ABORT, PREPARE TRANSACTION (which ends it too). Read
 * from its first keyword, after leading comments: what an ORM sends for its own transaction() is
 * that statement alone. Not a SQL parser: a multi-statement text is not split.
 */
export function endsTransaction (text: string): boolean {
  const start = text.replace(/^(?:\s+|--[^\n]*(?:\n|$)|\/\*[\s\S]*?\*\/)*/, '')
  return /^(?:begin|start\s+transaction|commit|end|abort|prepare\s+transaction|rollback(?!\s+(?:work\s+|transaction\s+)?to\b))\b/i.test(start)
}

const transactionControlError = (): Error => new Error(
  "fastify-idempotency: request.idempotency.sql is already inside the request's transaction, which the store commits with the recorded response; BEGIN, COMMIT and ROLLBACK on it would end that transaction early (an ORM's transaction() sends them): write through it directly, and use SAVEPOINT / ROLLBACK TO SAVEPOINT for a partial rollback"
)

const endedError = (): Error => new Error("fastify-idempotency: this request's transaction has ended (committed or rolled back); run no more queries through request.idempotency.sql")

/** The code postgres.js gives a query on a closed connection: one code for a handler to check, whichever the client. */
const lostError = (cause: unknown): Error => Object.assign(
  new Error("fastify-idempotency: the connection of this request's transaction closed, so PostgreSQL rolled the transaction back; nothing more is sent through request.idempotency.sql", { cause }),
  { code: 'CONNECTION_CLOSED' }
)

/** A refused query fails the way the caller is listening: its callback, a submittable's handler, or a rejected promise. */
function refuse (error: Error, args: unknown[]): unknown {
  const last = args[args.length - 1]
  if (typeof last === 'function') {
    process.nextTick(() => { (last as (err: Error) => void)(error) })
    return undefined
  }
  const submittable = args[0] as { submit?: unknown, handleError?: unknown } | null
  if (typeof submittable?.submit === 'function') {
    if (typeof submittable.handleError === 'function') {
      process.nextTick(() => { (submittable.handleError as (err: Error) => void).call(submittable, error) })
    }
    return submittable
  }
  return Promise.reject(error)
}
