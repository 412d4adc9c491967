/**
 * For the node-postgres-only suites (test/postgres/node-postgres/*, beyond the wrappers): a schema
 * of their own with a `payments` table, a pg.Pool of a known size and application_name for the
 * store, and a postgres.js client for the checks (its reads are unaffected by anything the suites
 * do to node-postgres: its pool, its global type parsers).
 */
import { randomBytes } from 'node:crypto'
import type { FastifyRequest } from 'fastify'
import pg from 'pg'
import type postgres from 'postgres'
import type { Test } from 'tap'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { postgresSchema } from './postgres-schema.js'
import { sleep } from './sleep.js'

export interface NodePostgresWorld {
  readonly schema: string
  /** The quoted, schema-qualified payments table (key text, amount int, ref text unique deferred). */
  readonly payTable: string
  readonly appName: string
  readonly pool: pg.Pool
  readonly max: number
  readonly admin: postgres.Sql
  /** A migrated store on the pool, on its own table of the schema. */
  store (table: string): Promise<PostgresStore>
  payments (key: string): Promise<number>
  records (table: string, key: string): Promise<string[]>
  /** The pool's backends that are idle inside a transaction (a client back in the pool mid-transaction). */
  idleInTransaction (): Promise<number>
}

export function nodePostgresWorld (t: Test, url: string, max = 4): NodePostgresWorld {
  const id = randomBytes(4).toString('hex')
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_pg',
    client: { max: 2 },
    // `ref` is checked at COMMIT: a duplicate makes the COMMIT itself fail.
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.payments (key text NOT NULL, amount integer NOT NULL,
      ref text UNIQUE DEFERRABLE INITIALLY DEFERRED)`
  })
  const appName = `idem-pg-${id}`
  const pool = new pg.Pool({ connectionString: url, max, application_name: appName, allowExitOnIdle: true })
  const stores: PostgresStore[] = []

  t.teardown(async () => {
    for (const store of stores) await store.close()
    await Promise.race([pool.end(), new Promise((resolve) => setTimeout(resolve, 2000).unref())])
  })

  return {
    schema,
    payTable: `"${schema}".payments`,
    appName,
    pool,
    max,
    admin,
    async store (table) {
      const store = postgresStore({ pool, schema, table, purgeInterval: 0 })
      await store.migrate()
      stores.push(store)
      return store
    },
    payments: async (key) => Number((await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.payments WHERE key = ${key}`)[0]?.n),
    records: async (table, key) => (await admin`SELECT state FROM ${admin(schema)}.${admin(table)} WHERE key = ${key}`).map((row) => String(row.state)),
    idleInTransaction: async () => Number((await admin`SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = ${appName} AND state LIKE 'idle in transaction%'`)[0]?.n)
  }
}

/**
 * The request's transaction as node-postgres's PoolClient: the type an application gets by declaring
 * `AtomicTransactionTypes { client: PoolClient }`, which this project cannot (its tests run on both clients).
 */
export function poolClientOf (request: FastifyRequest): pg.PoolClient {
  const client = request.idempotency?.sql
  if (client === undefined) throw new Error('not in atomic mode')
  return client as unknown as pg.PoolClient
}

export const keyed = (key: string): Record<string, string> => ({ 'idempotency-key': `"${key}"`, 'content-type': 'application/json' })

export function deferred (): { promise: Promise<void>, resolve: () => void } {
  let resolve!: () => void
  const promise = new Promise<void>((_resolve) => { resolve = _resolve })
  return { promise, resolve }
}

/** Open transactions once the ones in flight have ended (a replayed or refused request rolls its own back just after answering). */
export async function drained (store: PostgresStore): Promise<number> {
  for (let i = 0; i < 300 && store.openTransactions > 0; i++) await sleep(10)
  return store.openTransactions
}
