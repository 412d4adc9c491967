import { randomBytes } from 'node:crypto'
import Fastify from 'fastify'
import postgres from 'postgres'
import t from 'tap'
import idempotency from '../../lib/index.js'
import { postgresStore, type BackgroundTask } from '../../drivers/postgres/index.js'
import { CLIENT, CLIENT_NAME, endPools, poolLike, storeConnection } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * A pooled connection that dies while idle (pg_terminate_backend, a PostgreSQL restart, an idle
 * timeout of a proxy), with no request on it. The store's answer differs by client:
 *
 * - node-postgres emits the idle client's error on the pool, and a Pool without an 'error' listener
 *   throws it, which ends the process. So the store listens when the pool has no listener of its own
 *   (drivers/postgres/store.ts), and reports the error to onBackgroundError as task 'connection'.
 * - postgres.js notes the closed connection itself and opens another on the next query: it reports
 *   nothing, so onBackgroundError is not called.
 *
 * Either way the next request is served. The node-postgres run:
 * test/postgres/node-postgres/idle-connections.test.ts.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/idle-connections.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const { name: schema, sql } = postgresSchema(t, url, { prefix: 'idem_idle', client: { max: 4, fetch_types: false } })
  const clients: Array<postgres.Sql<any>> = []

  t.teardown(async () => {
    await Promise.all(clients.map((client) => client.end({ timeout: 1 })))
    await endPools()
  })

  /** A client of its own, named so that its backends can be found in pg_stat_activity. */
  function named (applicationName: string): postgres.Sql<any> {
    const client = postgres(url, { max: 4, onnotice: () => {}, fetch_types: false, connection: { application_name: applicationName } })
    clients.push(client)
    return client
  }

  async function until (what: string, check: () => boolean | Promise<boolean>, ms = 5000): Promise<boolean> {
    const deadline = Date.now() + ms
    while (!await check()) {
      if (Date.now() > deadline) { t.fail(`timed out waiting for ${what}`); return false }
      await sleep(10)
    }
    return true
  }

  if (CLIENT === 'pg') {
    t.test("the store adds a pool 'error' listener only when the pool has none", async (t) => {
      const bare = poolLike(named(`idem-idle-bare-${id}`))
      t.equal(bare.listenerCount('error'), 0, 'a new pg.Pool has no error listener')
      const first = postgresStore({ pool: bare, schema, purgeInterval: 0 })
      t.equal(bare.listenerCount('error'), 1, 'the store added one')
      const second = postgresStore({ pool: bare, schema, purgeInterval: 0 })
      t.equal(bare.listenerCount('error'), 1, 'a second store on the same pool adds none: the pool has one')

      const own = poolLike(named(`idem-idle-own-${id}`))
      const mine = (): void => {}
      own.on('error', mine)
      const third = postgresStore({ pool: own, schema, purgeInterval: 0 })
      t.same(own.listeners('error'), [mine], "the application's listener is the only one: the store adds none")
      await Promise.all([first.close(), second.close(), third.close()])
    })
  }

  t.test(`an idle pooled connection terminated: the next request is served (${CLIENT_NAME})`, async (t) => {
    const name = `idem-idle-victim-${id}`
    const victim = named(name)
    const seen: Array<{ task: BackgroundTask, error: unknown }> = []
    const store = postgresStore({
      ...storeConnection(victim),
      schema,
      purgeInterval: 0,
      onBackgroundError: (error, task) => { seen.push({ task, error }) }
    })
    await store.migrate()
    const app = Fastify()
    t.teardown(async () => { await app.close(); await store.close() })
    await app.register(idempotency, { store, scope: () => 'acct_a', lease: 1000 })
    let runs = 0
    app.post('/pay', async (_request, reply) => reply.code(201).send({ run: ++runs }))
    const pay = (key: string) => app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': `"${key}"` } })

    t.equal((await pay('before')).statusCode, 201)
    const idle = async (): Promise<number[]> =>
      (await sql<Array<{ pid: number }>>`SELECT pid FROM pg_stat_activity WHERE application_name = ${name} AND state = 'idle'`).map((row) => row.pid)
    await until('an idle connection of the store', async () => (await idle()).length > 0)
    const pids = await idle()
    for (const pid of pids) {
      const [row] = await sql<Array<{ done: boolean }>>`SELECT pg_terminate_backend(${pid}::int) AS done`
      t.equal(row?.done, true, `terminated idle backend ${pid}`)
    }
    await until('the backends to be gone', async () => (await sql`SELECT 1 FROM pg_stat_activity WHERE pid IN ${sql(pids)}`).length === 0)

    if (CLIENT === 'pg') {
      // One error per idle client: pg-pool's idle listener reports it once, then drops the client.
      await until("the pool's error to reach onBackgroundError", () => seen.length === pids.length)
      t.same(seen.map(({ task }) => task), pids.map(() => 'connection'), "reported as task 'connection', once per terminated client")
      t.ok(seen.every(({ error }) => error instanceof Error), 'with the error node-postgres emitted')
      const pool = poolLike(victim)
      await until('the pool to drop the dead clients', () => pool.totalCount === 0)
    } else {
      // Nothing to wait for: postgres.js reports an idle connection's close to no one.
      await sleep(200)
      t.same(seen, [], 'postgres.js reports nothing: onBackgroundError is not called')
    }

    const after = await pay('after')
    t.equal(after.statusCode, 201, 'the process still serves: the next request executes')
    t.same(after.json(), { run: 2 })
    const replay = await pay('before')
    t.equal(replay.headers['idempotent-replayed'], 'true', 'and the earlier record replays')
    t.equal(runs, 2)
  })
}
