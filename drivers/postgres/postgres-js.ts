import type { Sql, TransactionSql } from 'postgres'
import type { DatabaseClient, Queryable, Rows, TransactionConnection, Value } from './client.js'
import { beginOnLiveConnection, watched } from './dropped-connection.js'
import { guardTransaction } from './postgres-js-guard.js'

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

  function transactionConnection (tx: TransactionSql<any>, connection: TransactionConnection['connection']): TransactionConnection {
    const queryable = statementsOn(tx)
    return {
      connection,
      query: (text, values) => watched(connection, queryable.query(text, values)),
      async around (before, statement, after) {
        // postgres.js sends a query when it is first awaited: execute() puts `before` on the wire
        // first, the statement is sent as soon as it is called, and `after` behind it.
        const first = tx.unsafe(before).execute()
        const [, result] = await watched(connection, Promise.all([first, statement(), tx.unsafe(after)]))
        return result
      },
      guarded () {
        const guard = guardTransaction(tx, connection)
        // What enqueue() writes through: the guarded handle, so it too is refused once the transaction ended.
        handles.set(guard.sql, statementsOn(guard.sql))
        return { handle: guard.sql, end: guard.end }
      },
      async simple (text) {
        await watched(connection, tx.unsafe(text))
      }
    }
  }

  return {
    library: 'postgres',
    get maxConnections () {
      const max = (sql as { options?: { max?: unknown } }).options?.max
      return typeof max === 'number' ? max : undefined
    },
    ...statementsOn(sql),
    identifier: (name) => identifier(sql, name),
    transaction (body, hooks) {
      return beginOnLiveConnection(sql, async (tx, connection) => {
        const result = await body(transactionConnection(tx, connection))
        if (connection.lost !== null) throw connection.lost
        // Returning lets postgres.js send COMMIT.
        hooks?.commitSent?.()
        return result
      })
    },
    connectionOf: (handle) => (typeof handle === 'function' || typeof handle === 'object') && handle !== null ? handles.get(handle) ?? null : null,
    // A PANIC is not an answer about the commit: see node-postgres.ts, isServerError.
    isServerError: (err) => (err as { name?: unknown } | null)?.name === 'PostgresError' && (err as { severity?: unknown }).severity !== 'PANIC'
  }
}

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
