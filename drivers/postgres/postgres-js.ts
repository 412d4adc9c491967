import type { Sql, TransactionSql } from 'postgres'
import { TRANSACTION_MARK, type DatabaseClient, type Ended, type Queryable, type Rows, type TransactionConnection, type Value } from './client.js'
import { beginOnLiveConnection, watched } from './dropped-connection.js'
import { guardTransaction } from './postgres-js-guard.js'
import { listenOnPostgresJs } from './postgres-js-listen.js'

/**
 * The driver on a postgres.js (porsager) client. Every statement goes through `unsafe` with
 * `prepare: true`: prepared (named, once per connection) as a tagged template would be, and still
 * honouring a client created with `prepare: false` (postgres.js ANDs the two). Results are read
 * positionally (`.values()`), so a client created with a column-name transform (postgres.camel,
 * ...) reads the same columns.
 */

/** The rendering of `sql(name)`: postgres.js's Identifier keeps the quoted, escaped name in `value`. */
interface RenderedIdentifier { readonly value: unknown }

export function postgresJsClient (sql: Sql<any>): DatabaseClient {
  /** The connection behind each guarded handle this client gave out. */
  const handles = new WeakMap<object, Queryable>()

  /**
   * A transaction's connection, and what the client needs to know of its guarded handle: whether
   * its transaction ended under it and postgres.js took the connection back (client.ts, Ended).
   * From then on nothing is sent through the transaction: its methods throw.
   */
  function transactionConnection (tx: TransactionSql<any>, connection: TransactionConnection['connection'], marked: boolean): { readonly tx: TransactionConnection, givenBack (): Promise<boolean> } {
    const queryable = statementsOn(tx)
    let guard: ReturnType<typeof guardTransaction> | null = null
    /** Set when the guard ended: the driver's statements wait for the handle's last ones (client.ts, guarded). */
    let handleDone: Promise<Ended | null> | null = null
    let released = false
    /** Only once the guard has ended: until then a statement is sent the moment it is called. */
    const ready = async (done: Promise<unknown>): Promise<void> => {
      await done
      if (released) throw givenBackError()
    }
    const end = (): Promise<Ended | null> => {
      if (guard === null) return Promise.resolve(null)
      handleDone ??= guard.end().then((ended) => {
        released = ended?.released === true
        return ended
      })
      return handleDone
    }
    const txc: TransactionConnection = {
      connection,
      async query (text, values) {
        if (handleDone !== null) await ready(handleDone)
        return await watched(connection, queryable.query(text, values))
      },
      guarded () {
        // The probe's mark (client.ts, TRANSACTION_MARK), unless the body's first statement set it:
        // written ahead of the handle's first query (postgres.js sends in the order queries are
        // executed), no round trip of its own. A failure would be the transaction's, and rolls it
        // back as any failed statement does.
        if (!marked) watched(connection, tx.unsafe(TRANSACTION_MARK).execute()).catch(() => {})
        const guarded = guardTransaction(tx, connection)
        guard = guarded
        // What enqueue() writes through: the guarded handle, so it too is refused once the transaction ended.
        handles.set(guarded.sql, statementsOn(guarded.sql))
        return { handle: guarded.sql, end }
      },
      async simple (text) {
        if (handleDone !== null) await ready(handleDone)
        await watched(connection, tx.unsafe(text))
      }
    }
    // The handle's part is over once the body is: its end tells whether the connection is still the transaction's.
    return { tx: txc, givenBack: async () => (await end())?.released === true }
  }

  return {
    library: 'postgres',
    get maxConnections () {
      const max = (sql as { options?: { max?: unknown } }).options?.max
      return typeof max === 'number' ? max : undefined
    },
    ...statementsOn(sql),
    identifier: (name) => identifier(sql, name),
    /**
     * `sql.begin`, with one more case than dropped-connection.ts covers: once postgres.js has taken
     * the connection back (its transaction ended through the guarded handle and left the session
     * idle), the COMMIT or ROLLBACK it sends when the callback settles would run in whatever
     * session uses that connection next, maybe inside another transaction. The callback is then
     * left pending, as on a dropped connection, and the promise returned here settles by itself:
     * with what the body threw, or an error if it returned (nothing was committed by it).
     */
    transaction (body, hooks) {
      let giveBack!: (err: unknown) => void
      const givenBack = new Promise<never>((_resolve, reject) => { giveBack = reject })
      const begun = beginOnLiveConnection(sql, async (tx, connection) => {
        const transaction = transactionConnection(tx, connection, hooks?.marked === true)
        let result: Awaited<ReturnType<typeof body>>
        try {
          result = await body(transaction.tx)
        } catch (err) {
          if (connection.lost === null && await transaction.givenBack()) {
            giveBack(err)
            return await new Promise<never>(() => {})
          }
          throw err
        }
        if (connection.lost !== null) throw connection.lost
        if (await transaction.givenBack()) {
          giveBack(givenBackError())
          return await new Promise<never>(() => {})
        }
        // Returning lets postgres.js send COMMIT.
        hooks?.commitSent?.()
        return result
      })
      return Promise.race([begun, givenBack])
    },
    connectionOf: (handle) => (typeof handle === 'function' || typeof handle === 'object') && handle !== null ? handles.get(handle) ?? null : null,
    // A PANIC is not an answer about the commit: see node-postgres.ts, isServerError.
    isServerError: (err) => (err as { name?: unknown } | null)?.name === 'PostgresError' && (err as { severity?: unknown }).severity !== 'PANIC',
    listen: (channel, handlers) => listenOnPostgresJs(sql, channel, handlers)
  }
}

const givenBackError = (): Error => new Error('fastify-idempotency: the transaction ended through its handle, and postgres.js took its connection back to its pool: nothing more is sent through it, and nothing was committed by the driver')

function statementsOn (sql: Sql<any> | TransactionSql<any>): Queryable {
  return {
    async query (text: string, values: readonly Value[]): Promise<Rows> {
      const rows = await sql.unsafe(text, values as Value[], { prepare: true }).values()
      return { rows: rows as unknown as unknown[][], count: rows.count }
    }
  }
}

/**
 * `name` quoted and escaped by postgres.js itself: `sql(name)` is what a tagged template would
 * interpolate, so a client's column-name transform (postgres.camel, ...) applies to it as it did
 * when the table was created through `sql(name)`.
 */
function identifier (sql: Sql<any>, name: string): string {
  const rendered = (sql(name) as unknown as RenderedIdentifier).value
  if (typeof rendered !== 'string' || !rendered.startsWith('"')) {
    throw new Error('fastify-idempotency: this version of postgres.js renders identifiers in a way the Postgres driver does not know')
  }
  return rendered
}
