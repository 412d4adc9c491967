import { createHash } from 'node:crypto'
import { TRANSACTION_MARK, type DatabaseClient, type Ended, type Queryable, type Rows, type TransactionConnection, type TransactionHooks, type Value } from './client.js'
import { connectionState, type ConnectionState } from './dropped-connection.js'
import { guardPoolClient } from './node-postgres-guard.js'
import { listenOnNodePostgres, type NodePostgresClientSource } from './node-postgres-listen.js'
import { nodePostgresTypes } from './node-postgres-types.js'

/**
 * The driver on a node-postgres (`pg`) Pool, such as `fastify.pg.pool` from @fastify/postgres.
 * Typed structurally (pool.ts in this folder names no type of `pg`'s), so the driver's types load
 * without @types/pg; the option's validation checks the shape at register time.
 *
 * - Every statement is a named prepared statement (the name is a hash of its fixed text), read
 *   with `rowMode: 'array'` and the driver's own type parsers (node-postgres-types.ts).
 * - A transaction holds one client from `pool.connect()` for its whole life, with an 'error'
 *   listener on it: node-postgres emits a checked-out client's connection error as an 'error'
 *   event, and an EventEmitter without a listener throws it, which kills the process (the
 *   dropped-connection crash, in node-postgres's form: dropped-connection.ts). The client goes back with
 *   `release(err)` after a connection error, so the pool destroys it instead of reusing it.
 */

/** The parts of a node-postgres Pool the driver uses. */
export interface NodePostgresPool {
  /** The callback form: see checkOut. */
  connect (callback: (err: Error | undefined, client: NodePostgresPoolClient | undefined, done: (release?: unknown) => void) => void): void
  query (config: QueryConfig): Promise<QueryResult>
  on (event: 'error', listener: (err: Error) => void): unknown
  listenerCount (event: 'error'): number
  readonly options?: { readonly max?: number }
}

/** The parts of a node-postgres PoolClient the driver uses. */
export interface NodePostgresPoolClient {
  query (config: QueryConfig | string): Promise<QueryResult>
  release (err?: Error | boolean): void
  on (event: 'error', listener: (err: Error) => void): unknown
  removeListener (event: 'error', listener: (err: Error) => void): unknown
}

interface QueryConfig {
  readonly name?: string
  readonly text: string
  readonly values?: readonly Value[]
  readonly rowMode?: 'array'
  readonly types?: typeof nodePostgresTypes
}

interface QueryResult {
  readonly rows: unknown[]
  readonly rowCount: number | null
}

/** The messages node-postgres (lib/client.js) fails a query with when its connection is gone. */
const CONNECTION_MESSAGES = new Set([
  'Connection terminated unexpectedly',
  'Connection terminated',
  'Client has encountered a connection error and is not queryable',
  'Client was closed and is not queryable',
  // query_timeout: the query may still be running on the connection, which is not reused.
  'Query read timeout'
])

/**
 * True for an error after which the connection is not to be used again: one of node-postgres's
 * own (it has no codes), a socket's (a Node system error, with `syscall`), or a FATAL or PANIC
 * the server sent before ending the session (57P01 from pg_terminate_backend).
 */
export function isNodePostgresConnectionError (err: unknown): boolean {
  if (err === null || typeof err !== 'object') return false
  const { message, syscall, severity, code } = err as { message?: unknown, syscall?: unknown, severity?: unknown, code?: unknown }
  if (severity === 'FATAL' || severity === 'PANIC') return true
  // node-postgres reads the localized severity (lc_messages): the SQLSTATEs of a session the server
  // ends say the same in any language (57P01-57P03 operator intervention, class 08, 25P03 idle timeout).
  if (typeof code === 'string' && (/^57P0[1-3]$/.test(code) || code.startsWith('08') || code === '25P03')) return true
  return typeof syscall === 'string' || (typeof message === 'string' && CONNECTION_MESSAGES.has(message))
}

/**
 * An error the server sent, which it sends only for a transaction it did not commit: node-postgres's
 * DatabaseError has its SQLSTATE and severity. A FATAL counts (PostgreSQL holds interrupts while it
 * writes the commit record, and after a local commit it ends the session without sending one); a
 * PANIC does not, since the server may fail in a critical section after the record was written.
 */
function isServerError (err: unknown): boolean {
  if (!(err instanceof Error)) return false
  const { code, severity } = err as { code?: unknown, severity?: unknown }
  return typeof code === 'string' && /^[0-9A-Z]{5}$/.test(code) && typeof severity === 'string' && severity !== 'PANIC'
}

const names = new Map<string, string>()

/** A statement's name: the same text always gets the same one, and two texts never share one. */
function statementName (text: string): string {
  let name = names.get(text)
  if (name === undefined) {
    name = `fastify_idempotency_${createHash('sha256').update(text).digest('hex').slice(0, 32)}`
    names.set(text, name)
  }
  return name
}

function prepared (text: string, values: readonly Value[]): QueryConfig {
  return { name: statementName(text), text, values, rowMode: 'array', types: nodePostgresTypes }
}

/**
 * `pool.connect()` with `onError` on the client from the moment pg-pool hands it over. pg-pool
 * takes its own (idle) listener off the client and then calls back; through `connect()`'s promise
 * the caller runs a microtask later, which is too late when the hand-over happens inside a socket
 * read: a `pool.query` finishing on the client releases it, from its ReadyForQuery, to a waiting
 * `connect()`, and a server message in the same read (the FATAL of `pg_terminate_backend`, which
 * a busy process reads together with the answer before it) is emitted as an 'error' on a client
 * with no listener, which throws and ends the process (the chaos harness died of exactly this).
 * The callback is called at the hand-over itself, so no message comes between.
 */
function checkOut (pool: NodePostgresPool, onError: (err: Error) => void): Promise<NodePostgresPoolClient> {
  return new Promise((resolve, reject) => {
    pool.connect((err, client) => {
      if (err !== undefined && err !== null) return reject(err)
      if (client === undefined) return reject(new Error('fastify-idempotency: pool.connect() gave no client'))
      client.on('error', onError)
      resolve(client)
    })
  })
}

const rowsOf = (result: QueryResult): Rows => ({ rows: result.rows as unknown[][], count: result.rowCount ?? 0 })

export function nodePostgresClient (pool: NodePostgresPool): DatabaseClient {
  const handles = new WeakMap<object, Queryable>()

  /**
   * `endHandle` ends the guarded handle's part, if one was given out (transaction(): before COMMIT
   * or ROLLBACK, so none of its queries, still waiting in its own line, is sent after them).
   */
  function transactionConnection (client: NodePostgresPoolClient, connection: ConnectionState): { readonly tx: TransactionConnection, endHandle (): Promise<unknown> } {
    let guard: ReturnType<typeof guardPoolClient> | null = null
    /** Set when the guard ended: the driver's statements wait for the handle's last ones (client.ts, guarded). */
    let handleDone: Promise<Ended | null> | null = null
    const end = (): Promise<Ended | null> => {
      if (guard === null) return Promise.resolve(null)
      handleDone ??= guard.end()
      return handleDone
    }
    const watch = async (sent: Promise<QueryResult>): Promise<QueryResult> => {
      try {
        return await sent
      } catch (err) {
        if (isNodePostgresConnectionError(err)) connection.lose(err)
        throw err
      }
    }
    const live = (): void => { if (connection.lost !== null) throw connection.lost }
    const queryable: Queryable = {
      async query (text, values) {
        if (handleDone !== null) await handleDone
        live()
        return rowsOf(await watch(client.query(prepared(text, values))))
      }
    }
    const tx: TransactionConnection = {
      connection,
      query: queryable.query,
      guarded () {
        // TRANSACTION_MARK went with BEGIN, or the body's first statement set it (transaction(), below).
        const guarded = guardPoolClient(client, connection, isNodePostgresConnectionError, (text) => ({ text, rowMode: 'array', types: nodePostgresTypes }))
        guard = guarded
        // What enqueue() writes through: the guarded client, so it too is refused once the transaction ended.
        const handle = guarded.handle as NodePostgresPoolClient
        handles.set(guarded.handle, { query: async (text, values) => rowsOf(await handle.query(prepared(text, values))) })
        return { handle: guarded.handle, end }
      },
      async simple (text) {
        if (handleDone !== null) await handleDone
        live()
        await watch(client.query(text))
      }
    }
    return { tx, endHandle: end }
  }

  return {
    library: 'pg',
    get maxConnections () {
      const max = pool.options?.max
      return typeof max === 'number' ? max : undefined
    },
    async query (text, values) {
      return rowsOf(await pool.query(prepared(text, values)))
    },
    identifier: (name) => `"${name.replaceAll('"', '""')}"`,
    async transaction (body, hooks?: TransactionHooks) {
      const connection = connectionState()
      const onError = (err: Error): void => { connection.lose(err) }
      const client = await checkOut(pool, onError)
      const { tx, endHandle } = transactionConnection(client, connection)
      /** BEGIN was sent and COMMIT not yet: a ROLLBACK is due if anything fails. */
      let open = false
      /** The connection is in a state no one should reuse (a ROLLBACK that failed). */
      let broken: Error | null = null
      try {
        // BEGIN and, in the same round trip, the mark a guarded handle's probe reads (client.ts,
        // TRANSACTION_MARK), unless the body's first statement sets it (atomic mode's claim): a
        // node-postgres client sends one query at a time, so setting it later would cost a round
        // trip. Open from here: if the mark fails after BEGIN, the client must not go back to the
        // pool inside an aborted transaction block (a ROLLBACK without one is only a warning).
        open = true
        await tx.simple(hooks?.marked === true ? 'BEGIN' : `BEGIN; ${TRANSACTION_MARK}`)
        const result = await body(tx)
        await endHandle()
        if (connection.lost !== null) throw connection.lost
        open = false
        hooks?.commitSent?.()
        await tx.simple('COMMIT')
        return result
      } catch (err) {
        if (open && connection.lost === null) {
          try {
            await endHandle()
            await tx.simple('ROLLBACK')
          } catch (rollbackError) {
            broken = rollbackError as Error
          }
        }
        // A lost connection explains the failure better than what it made the body throw.
        throw connection.lost ?? err
      } finally {
        const destroy = connection.lost ?? broken
        if (destroy === null) {
          client.removeListener('error', onError)
          client.release()
        } else {
          // The listener stays: a destroyed client may still report its socket's end.
          client.release(destroy instanceof Error ? destroy : new Error('connection lost', { cause: destroy }))
        }
      }
    },
    connectionOf: (handle) => typeof handle === 'object' && handle !== null ? handles.get(handle) ?? null : null,
    isServerError,
    listen: (channel, handlers) => listenOnNodePostgres(pool as NodePostgresClientSource, channel, handlers)
  }
}
