import type { Sql, TransactionSql } from 'postgres'

/**
 * A transaction whose connection dropped must not send anything more: postgres.js 3.4.9 writes a
 * statement given to a transaction straight to that transaction's connection, also after the
 * connection closed, and the write then runs from a setImmediate on a socket that is already null:
 * `TypeError: Cannot read properties of null (reading 'write') at Immediate.nextWrite`, which no
 * caller can catch, and the process dies (porsager/postgres#1208, #1154; the unreleased fix, #1209,
 * makes `sql.begin` refuse exactly these statements). The one that killed atomic-mode processes in
 * test/postgres/dropped-connection.test.ts was `sql.begin`'s own ROLLBACK, sent because
 * the callback threw when the claim's or the handler's statement failed with CONNECTION_CLOSED; the
 * handler's next query and the recorded response would reach the same write.
 *
 * So a transaction notes the moment postgres.js reports its connection gone (below), and from then
 * on sends nothing: the handler's queries are refused (transaction.ts, guardTransaction), and the
 * `sql.begin` callback never settles, so postgres.js sends neither ROLLBACK nor COMMIT. Nothing is
 * lost by not sending ROLLBACK: PostgreSQL rolls back the transaction of a session that ended.
 * The pending callback holds nothing once its request settled (nothing references its promise).
 */

/** What one transaction knows of its connection. */
export interface ConnectionState {
  /** The error postgres.js reported the connection gone with; null while it is usable. */
  readonly lost: unknown
  /** Notes the connection gone (the first error wins) and tells every listener, once. */
  lose (err: unknown): void
  /** Runs `listener` when the connection is lost (at once if it already is). */
  onLost (listener: (err: unknown) => void): void
}

export function connectionState (): ConnectionState {
  let lost: unknown = null
  const listeners: Array<(err: unknown) => void> = []
  return {
    get lost () { return lost },
    lose (err) {
      if (lost !== null) return
      lost = err ?? new Error('connection lost')
      for (const listener of listeners.splice(0)) listener(lost)
    },
    onLost (listener) {
      if (lost !== null) listener(lost)
      else listeners.push(listener)
    }
  }
}

/**
 * Codes of the errors postgres.js gives a query whose connection went away (src/errors.js,
 * `Errors.connection`). A socket's own error (ECONNRESET, EPIPE, ETIMEDOUT…) is a Node system
 * error, recognised by its `syscall`.
 */
const CONNECTION_CODES = new Set(['CONNECTION_CLOSED', 'CONNECTION_DESTROYED', 'CONNECTION_ENDED', 'CONNECT_TIMEOUT'])

/**
 * True for an error that means the connection is gone. Not an error the server sent
 * (PostgresError) on a live session, except a FATAL or PANIC one, after which the server ends the
 * session (57P01 from pg_terminate_backend when no statement was running, 25P03 from
 * idle_in_transaction_session_timeout).
 */
export function isConnectionError (err: unknown): boolean {
  if (err === null || typeof err !== 'object') return false
  const { name, code, syscall, severity } = err as { name?: unknown, code?: unknown, syscall?: unknown, severity?: unknown }
  if (name === 'PostgresError') return severity === 'FATAL' || severity === 'PANIC'
  return (typeof code === 'string' && CONNECTION_CODES.has(code)) || typeof syscall === 'string'
}

/**
 * `sql.begin(body)`, but nothing is sent on the connection once it is lost: when `body` fails
 * after that, the callback stays pending instead of letting postgres.js send ROLLBACK (and a
 * `body` that finds the connection lost before it returns throws, so no COMMIT is sent either).
 * The connection is lost when `sql.begin` settles while `body` is still running (it races the
 * callback against the connection's close, postgres.js src/index.js `begin`, so only a closed
 * connection does that), or when a statement of the transaction failed with a connection error
 * (reported through {@link watched} and the guard). Not when `body` fails with a connection error
 * of its own: a step's `fetch` that got ECONNRESET says nothing of this connection, and taking it
 * for lost would leave a live transaction open forever. The returned promise is `sql.begin`'s.
 */
export function beginOnLiveConnection<T> (
  sql: Sql<any>,
  body: (tx: TransactionSql<any>, connection: ConnectionState) => Promise<T>
): Promise<T> {
  const connection = connectionState()
  let running = true
  const finished = sql.begin(async (tx) => {
    try {
      return await body(tx, connection)
    } catch (err) {
      if (connection.lost !== null) return await new Promise<never>(() => {})
      throw err
    } finally {
      running = false
    }
  }) as Promise<T>
  // Registered before anyone else's reaction to `finished`, so the state is set when they run.
  finished.catch((err: unknown) => { if (running) connection.lose(err) })
  return finished
}

/**
 * Awaits a statement of the transaction, noting a connection error before the caller sees it: the
 * caller's next step (a further statement, or throwing, which makes postgres.js send ROLLBACK)
 * then finds the connection lost.
 */
export async function watched<T> (connection: ConnectionState, statement: Promise<T>): Promise<T> {
  try {
    return await statement
  } catch (err) {
    if (isConnectionError(err)) connection.lose(err)
    throw err
  }
}
