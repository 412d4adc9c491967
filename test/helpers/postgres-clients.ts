/**
 * Which PostgreSQL client a test run puts the store on. `IDEM_PG_CLIENT=pg` selects node-postgres; anything else, postgres.js. The wrappers in
 * test/postgres/node-postgres/ set it and import the suite, so one tap run covers both clients.
 *
 * The tests keep their postgres.js client for their own reads and writes (rows in the database,
 * lock probes, pg_terminate_backend): only the store, and what the handler writes through
 * `request.idempotency.sql`, move to the client under test.
 */
import pg from 'pg'
import postgres, { type Sql } from 'postgres'

export type ClientKind = 'postgres' | 'pg'

export const CLIENT: ClientKind = process.env.IDEM_PG_CLIENT === 'pg' ? 'pg' : 'postgres'

/** For test titles and messages. */
export const CLIENT_NAME = CLIENT === 'pg' ? 'node-postgres' : 'postgres.js'

const pools = new WeakMap<object, pg.Pool>()
const opened: pg.Pool[] = []

interface PostgresJsOptions {
  readonly host: readonly string[]
  readonly port: readonly number[]
  readonly database: string
  readonly user: string
  readonly pass: unknown
  readonly max: number
  readonly connection?: Readonly<Record<string, unknown>>
}

/**
 * A node-postgres Pool on the same server, database, user, pool size and application_name as a
 * postgres.js client (one per client, ended by {@link endPools}).
 */
export function poolLike (sql: Sql<any>, overrides: pg.PoolConfig = {}): pg.Pool {
  const existing = pools.get(sql)
  if (existing !== undefined && Object.keys(overrides).length === 0) return existing
  const options = (sql as unknown as { options: PostgresJsOptions }).options
  // postgres.js sends `connection` as startup parameters; node-postgres takes the same as `-c` options.
  const { application_name: applicationName, ...settings } = options.connection ?? {}
  const startup = Object.entries(settings).map(([name, value]) => `-c ${name}=${String(value)}`).join(' ')
  const pool = new pg.Pool({
    host: options.host[0],
    port: options.port[0],
    database: options.database,
    user: options.user,
    password: typeof options.pass === 'string' ? options.pass : undefined,
    max: options.max,
    application_name: typeof applicationName === 'string' ? applicationName : undefined,
    ...(startup === '' ? {} : { options: startup }),
    // The test's process may exit while connections sit idle.
    allowExitOnIdle: true,
    ...overrides
  })
  opened.push(pool)
  if (Object.keys(overrides).length === 0) pools.set(sql, pool)
  return pool
}

/**
 * What postgresStore (and migrate) get for the client under test: `{ sql }` itself, or
 * `{ pool }` on the same server with the same pool size and application_name.
 */
export function storeConnection (sql: Sql<any>): { sql: Sql<any> } | { pool: pg.Pool } {
  return CLIENT === 'pg' ? { pool: poolLike(sql) } : { sql }
}

/** Ends every pool {@link poolLike} opened; bounded, as the postgres.js clients' end is. */
/**
 * What `storeConnection(sql)` gives, on a client that adds the text of every statement it sends to
 * `sent`: a node-postgres pool of clients whose `query` notes its text or query object's `.text`,
 * or a postgres.js client of its own whose `debug` hook sees every text (ended by `end()`).
 */
export function recordingConnection (url: string, sql: Sql<any>, sent: Set<string>): { connection: { sql: Sql<any> } | { pool: pg.Pool }, end: () => Promise<void> } {
  const note = (statement: unknown): void => {
    const text = typeof statement === 'string' ? statement : (statement as { text?: unknown } | null)?.text
    if (typeof text === 'string') sent.add(text)
  }
  if (CLIENT === 'pg') {
    class RecordingClient extends pg.Client {
      constructor (config?: pg.ClientConfig) {
        super(config)
        const query = this.query.bind(this) as (...args: unknown[]) => unknown
        Object.assign(this, { query: (...args: unknown[]) => { note(args[0]); return query(...args) } })
      }
    }
    return { connection: { pool: poolLike(sql, { Client: RecordingClient }) }, end: async () => {} }
  }
  const recorder = postgres(url, { max: 4, fetch_types: false, onnotice: () => {}, debug: (_connection, text) => { note(text) } })
  return { connection: { sql: recorder }, end: () => recorder.end({ timeout: 1 }) }
}

export async function endPools (): Promise<void> {
  const all = opened.splice(0)
  await Promise.race([
    Promise.allSettled(all.map((pool) => pool.end())),
    new Promise((resolve) => setTimeout(resolve, 2000).unref())
  ])
}

/**
 * Runs `text` with `$n` parameters on a request's transaction, whichever client it is: a
 * postgres.js TransactionSql (`unsafe`) or a node-postgres PoolClient (`query`). Rows as objects.
 */
export async function exec (handle: unknown, text: string, values: readonly unknown[] = []): Promise<Array<Record<string, unknown>>> {
  if (typeof handle === 'function') {
    return await (handle as Sql<any>).unsafe(text, values as never[]) as unknown as Array<Record<string, unknown>>
  }
  if (typeof handle === 'object' && handle !== null && typeof (handle as pg.PoolClient).query === 'function') {
    const result = await (handle as pg.PoolClient).query(text, values as unknown[])
    return result.rows as Array<Record<string, unknown>>
  }
  throw new TypeError(`exec: not a transaction handle: ${String(handle)}`)
}

/** The client under test itself, for `migrate(client, …)`: the postgres.js client or its node-postgres Pool. */
export function clientUnderTest (sql: Sql<any>): Sql<any> | pg.Pool {
  return CLIENT === 'pg' ? poolLike(sql) : sql
}
