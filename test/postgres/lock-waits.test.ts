import { randomBytes } from 'node:crypto'
import postgres from 'postgres'
import t from 'tap'
import { activitySource, waitingOnLock, type ActivitySource } from '../helpers/lock-waits.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The lock-wait probe of the Postgres tests (test/helpers/lock-waits.ts), on plain PostgreSQL and
 * on the shape Citus gives the same wait. Citus cannot run here, so its
 * `citus_stat_activity` is modelled by a view with the same leading columns over this server's
 * pg_stat_activity: the client's backend is a "coordinator" backend with global_pid
 * 10000000000 + pid, and the backend that actually waits on the row is a "worker" one, named
 * `citus_internal gpid=<that global_pid>` as Citus names the backends it opens on a worker.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/lock-waits.test.ts`.')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const clients: Array<postgres.Sql<any>> = []
  const client = (applicationName: string, max = 1): postgres.Sql<any> => {
    const sql = postgres(url, { max, onnotice: () => {}, connection: { application_name: applicationName } })
    clients.push(sql)
    return sql
  }
  t.teardown(async () => {
    await Promise.all(clients.map((c) => c.end({ timeout: 2 })))
  })
  const { name: schema, sql } = postgresSchema(t, url, {
    prefix: 'idem_waits',
    // one connection is reserved by blockOnRow's holder
    client: { max: 4, connection: { application_name: `idem-waits-admin-${id}` } },
    setup: async ({ sql, name: schema }) => {
      await sql`CREATE TABLE ${sql(schema)}.rows (scope text NOT NULL, key text NOT NULL, PRIMARY KEY (scope, key))`
      // citus_stat_activity's leading columns (global_pid, nodeid, is_worker_query), then pg_stat_activity's.
      await sql`
        CREATE VIEW ${sql(schema)}.citus_stat_activity AS
        SELECT CASE WHEN a.application_name LIKE 'citus\\_internal gpid=%'
                    THEN substring(a.application_name FROM 'gpid=([0-9]+)')::bigint
                    ELSE 10000000000 + a.pid END AS global_pid,
               1 AS nodeid,
               a.application_name LIKE 'citus\\_internal gpid=%' AS is_worker_query,
               a.*
        FROM pg_stat_activity a`
    }
  })

  /** Bounded poll: the probe must turn `expected` within 5 s (the wait starts asynchronously). */
  async function eventually (probe: () => Promise<boolean>, expected: boolean): Promise<boolean> {
    const deadline = Date.now() + 5000
    for (;;) {
      const seen = await probe()
      if (seen === expected || Date.now() > deadline) return seen
      await sleep(10)
    }
  }

  t.test('the source follows the citus extension: citus_stat_activity with it, pg_stat_activity without', async (t) => {
    const citus = (await sql`SELECT 1 FROM pg_extension WHERE extname = 'citus'`).length > 0
    t.same(await activitySource(sql), citus ? { kind: 'citus', schema: 'pg_catalog', view: 'citus_stat_activity' } : { kind: 'postgres' },
      citus ? 'citus is installed' : 'no citus extension here')
  })

  /**
   * Another transaction holds an uncommitted row; `waiter` inserts the same key and blocks on it.
   * Returns the pending insert and the function that ends the holder's transaction.
   */
  async function blockOnRow (waiter: postgres.Sql<any>, key: string): Promise<{ pending: Promise<unknown>, end: () => Promise<void> }> {
    const holder = await sql.reserve()
    await holder`BEGIN`
    await holder`INSERT INTO ${sql(schema)}.rows VALUES ('s', ${key})`
    const pending = waiter`INSERT INTO ${sql(schema)}.rows VALUES ('s', ${key}) ON CONFLICT DO NOTHING`.then(() => 'done', (err: Error) => err.message)
    return { pending, end: async () => { await holder`ROLLBACK`; holder.release() } }
  }

  t.test('pg_stat_activity: the blocked backend is found by its name, and only while it waits', async (t) => {
    const source: ActivitySource = { kind: 'postgres' }
    const name = `idem-waits-plain-${id}`
    const waiter = client(name)
    t.equal(await waitingOnLock(sql, source, name), false, 'nothing waits yet')
    const { pending, end } = await blockOnRow(waiter, 'plain')
    t.equal(await eventually(() => waitingOnLock(sql, source, name), true), true, 'the blocked insert is seen')
    t.equal(await waitingOnLock(sql, source, `idem-waits-nobody-${id}`), false, 'another name is not')
    await end()
    t.equal(await pending, 'done', 'the insert went on once the holder rolled back')
    t.equal(await waitingOnLock(sql, source, name), false, 'no longer waiting')
  })

  t.test("Citus's shape: the wait is on a worker backend working for the client's coordinator backend", async (t) => {
    const citus: ActivitySource = { kind: 'citus', schema, view: 'citus_stat_activity' }
    const name = `idem-waits-coordinator-${id}`
    const coordinator = client(name)
    const [backend] = await coordinator<Array<{ pid: number }>>`SELECT pg_backend_pid() AS pid`
    const gpid = 10000000000 + (backend?.pid ?? 0)
    const worker = client(`citus_internal gpid=${gpid}`)
    const bystander = client(`idem-waits-bystander-${id}`)
    await bystander`SELECT 1`
    const { pending, end } = await blockOnRow(worker, 'citus')
    t.equal(await eventually(() => waitingOnLock(sql, citus, name), true), true, "citus_stat_activity: the worker's wait is the client's")
    t.equal(await waitingOnLock(sql, { kind: 'postgres' }, name), false,
      "pg_stat_activity by name misses it: the client's own backend is not the one waiting (what the old probes saw on Citus)")
    t.equal(await waitingOnLock(sql, citus, `idem-waits-bystander-${id}`), false, 'a backend the worker does not work for is not waiting')
    await end()
    t.equal(await pending, 'done')
    t.equal(await waitingOnLock(sql, citus, name), false, 'no longer waiting')
  })
}
