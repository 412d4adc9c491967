import Fastify, { type FastifyInstance } from 'fastify'
import postgres from 'postgres'
import t, { type Test } from 'tap'
import idempotency, { type IdempotencyStore } from '../../lib/index.js'
import { postgresStore } from '../../drivers/postgres/index.js'
import { CLIENT_NAME, endPools, exec, storeConnection } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Atomic mode's waiting duplicates hold nothing: a duplicate of an original whose transaction is
 * open learns that the key is taken without waiting on the original's lock, and waits outside any
 * transaction until the original settles (woken in its own process, or by the store's settlement
 * notice from another one). Two instances, each on a client of its own with a pool of 10; their
 * connections are counted in pg_stat_activity by application_name. The store runs on the client
 * under test (test/helpers/postgres-clients.ts; the node-postgres run:
 * test/postgres/node-postgres/atomic-waiters.test.ts).
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/atomic-waiters.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const { name: schema, sql } = postgresSchema(t, url, {
    prefix: 'idem_atomic_waiters',
    client: { max: 4 },
    setup: async ({ sql, name }) => {
      await sql`CREATE TABLE ${sql(name)}.payments (key text NOT NULL, amount int NOT NULL)`
    }
  })
  let tables = 0
  t.teardown(endPools)

  interface Instance {
    readonly app: FastifyInstance
    readonly applicationName: string
    /** Atomic claims this instance sent, and how many of them answered "in progress". */
    claims: number
    refused: number
  }

  interface World {
    readonly table: string
    readonly runs: { count: number }
    /** Per run: whether it throws, and the gate it waits for before answering. */
    plan: Array<{ fail?: boolean, gate?: Promise<void> }>
    readonly instances: [Instance, Instance]
    post (instance: Instance, key: string): Promise<{ status: number, replayed: boolean, body: string }>
  }

  async function world (t: Test, wait = 20_000): Promise<World> {
    const table = `records_${++tables}`
    const runs = { count: 0 }
    const instances: Instance[] = []
    const w: World = {
      table,
      runs,
      plan: [],
      instances: instances as unknown as [Instance, Instance],
      async post (instance: Instance, key: string) {
        const response = await instance.app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': `"${key}"` }, payload: { amount: 5 } })
        return { status: response.statusCode, replayed: response.headers['idempotent-replayed'] === 'true', body: response.body }
      }
    }
    for (let i = 0; i < 2; i++) {
      const applicationName = `idem-atomic-waiters-${process.pid}-${tables}-${i}`
      const client = postgres(url, { max: 10, fetch_types: false, onnotice: () => {}, connection: { application_name: applicationName } })
      const store = postgresStore({ ...storeConnection(client), schema, table, purgeInterval: 0 })
      if (i === 0) await store.migrate()
      const claimInTransaction = store.claimInTransaction.bind(store)
      const counted: IdempotencyStore = {
        ...store,
        async claimInTransaction (request) {
          instance.claims++
          const result = await claimInTransaction(request)
          if (result.outcome === 'in_progress') instance.refused++
          return result
        }
      }
      const app = Fastify()
      await app.register(idempotency, { store: counted, scope: () => 'acct', transaction: true, wait })
      app.post<{ Body: { amount: number } }>('/pay', async (request) => {
        const step = w.plan[runs.count] ?? {}
        const run = ++runs.count
        await exec(request.idempotency?.sql, `INSERT INTO "${schema}".payments (key, amount) VALUES ($1, $2)`, [request.idempotency?.key ?? '', request.body.amount])
        await step.gate
        if (step.fail === true) throw new Error('the card network timed out')
        return { run }
      })
      // A route without idempotency, on the same pool as the store.
      app.get('/unrelated', async () => (await client`SELECT 1 AS one`)[0])
      await app.ready()
      const instance: Instance = { app, applicationName, claims: 0, refused: 0 }
      instances.push(instance)
      t.teardown(async () => { await app.close(); await store.close(); await client.end({ timeout: 2 }) })
    }
    // Each instance's first claim opens its settlement listener: one request each, then until both listen.
    for (const [i, instance] of instances.entries()) await w.post(instance, `warm-up-${i}`)
    for (let i = 0; i < 500; i++) {
      const [{ listening }] = await sql<[{ listening: number }]>`
        SELECT count(*)::int AS listening FROM pg_stat_activity
        WHERE application_name LIKE ${`idem-atomic-waiters-${process.pid}-${tables}-%`} AND query ILIKE 'LISTEN%' AND state = 'idle'`
      if (listening === 2) break
      await sleep(10)
    }
    await sleep(20)
    runs.count = 0
    for (const instance of instances) { instance.claims = 0; instance.refused = 0 }
    return w
  }

  /** Connections of `instance`'s pool in a transaction or running a statement. */
  async function busy (instance: Instance): Promise<number> {
    const [{ count }] = await sql<[{ count: number }]>`
      SELECT count(*)::int AS count FROM pg_stat_activity
      WHERE application_name = ${instance.applicationName} AND state IN ('active', 'idle in transaction', 'idle in transaction (aborted)')`
    return count
  }

  async function payments (key: string): Promise<number> {
    const [{ count }] = await sql<[{ count: number }]>`SELECT count(*)::int AS count FROM ${sql(schema)}.payments WHERE key = ${key}`
    return count
  }

  function gate (): { promise: Promise<void>, open: () => void } {
    let open!: () => void
    const promise = new Promise<void>((resolve) => { open = resolve })
    return { promise, open }
  }

  t.test(`50 waiting duplicates hold no pooled connection, and an unrelated request on the same pool completes (${CLIENT_NAME})`, async (t) => {
    const w = await world(t)
    const [a, b] = w.instances
    const original = gate()
    w.plan = [{ gate: original.promise }]
    const first = w.post(a, 'storm-1')
    for (let i = 0; i < 500 && w.runs.count === 0; i++) await sleep(5)
    const duplicates = Array.from({ length: 50 }, (_, i) => w.post(i % 2 === 0 ? a : b, 'storm-1'))
    // The duplicates of each instance are told the key is taken by claims they share (those that
    // arrive while one is in flight join it: lib/core/shared-calls.ts), and now wait.
    for (let i = 0; i < 1_000 && (a.refused < 1 || b.refused < 1); i++) await sleep(5)
    await sleep(200)
    t.ok(a.refused >= 1 && a.refused <= 25, `a: the key found taken by ${a.refused} claim(s) for 25 duplicates`)
    t.ok(b.refused >= 1 && b.refused <= 25, `b: the key found taken by ${b.refused} claim(s) for 25 duplicates`)
    t.equal(await busy(a), 1, 'instance a: one connection busy, the original\'s open transaction')
    t.equal(await busy(b), 0, 'instance b: none')
    const started = Date.now()
    const unrelated = await Promise.all([a, b].map((instance) => instance.app.inject({ method: 'GET', url: '/unrelated' })))
    t.same(unrelated.map((response) => response.statusCode), [200, 200], 'the unrelated route answered on both instances')
    t.ok(Date.now() - started < 2_000, `in ${Date.now() - started} ms`)
    original.open()
    const answers = await Promise.all(duplicates)
    t.equal((await first).status, 200)
    t.equal(w.runs.count, 1, 'the handler ran once')
    t.equal(await payments('storm-1'), 1, 'one payment row')
    t.same([...new Set(answers.map((answer) => `${answer.status} ${String(answer.replayed)}`))], ['200 true'], 'every duplicate got the replay')
    // At most one claim each when they came (shared: fewer); woken, the waiters read the record
    // instead. A slow machine may add one each (every 2 s, in case a notice was lost); polling
    // would make several more.
    t.ok(a.claims <= 1 + 25 * 2, `a: ${a.claims} claims for the original and 25 waiters`)
    t.ok(b.claims <= 25 * 2, `b: ${b.claims} claims for 25 waiters`)
  })

  t.test(`a released original lets exactly one waiter run; its write and record commit, the original's rolled back (${CLIENT_NAME})`, async (t) => {
    const w = await world(t)
    const [a, b] = w.instances
    const original = gate()
    w.plan = [{ fail: true, gate: original.promise }]
    const first = w.post(a, 'storm-2')
    for (let i = 0; i < 500 && w.runs.count === 0; i++) await sleep(5)
    const duplicates = [a, a, a, b, b, b].map((instance) => w.post(instance, 'storm-2'))
    for (let i = 0; i < 1_000 && (a.refused < 3 || b.refused < 3); i++) await sleep(5)
    original.open()
    t.equal((await first).status, 500, 'the original failed: its transaction rolled back')
    const answers = await Promise.all(duplicates)
    t.equal(w.runs.count, 2, 'one waiter ran the operation')
    t.same(answers.map((answer) => answer.status), [200, 200, 200, 200, 200, 200])
    t.equal(answers.filter((answer) => !answer.replayed).length, 1, 'one fresh answer')
    t.equal(new Set(answers.map((answer) => answer.body)).size, 1, 'the others replay it')
    t.equal(await payments('storm-2'), 1, 'one payment row: the waiter\'s')
  })

  t.test(`a lock that is no claim's, held past the whole wait, gets no 409: the claim waits it out and runs (${CLIENT_NAME})`, async (t) => {
    // The class: a claim answered "in progress" when no attempt of the key holds it. A claim gives
    // up only on the key's own lock (an attempt of the key in flight); a table's lock, as DDL takes,
    // is waited for as any statement waits for it, however long the route's wait.
    const w = await world(t, 300)
    const [a] = w.instances
    const release = gate()
    const locked = gate()
    const locker = sql.begin(async (tx) => {
      await tx`LOCK TABLE ${tx(schema)}.${tx(w.table)} IN ACCESS EXCLUSIVE MODE`
      locked.open()
      await release.promise
    })
    await locked.promise
    const started = Date.now()
    const answer = w.post(a, 'locked-1')
    const waiting = async (): Promise<boolean> => (await sql`
      SELECT 1 FROM pg_locks WHERE relation = ${`"${schema}"."${w.table}"`}::regclass AND NOT granted`).length > 0
    for (let i = 0; i < 500 && !await waiting(); i++) await sleep(5)
    t.ok(await waiting(), 'the claim waits on the table lock')
    await sleep(Math.max(0, 400 - (Date.now() - started)))
    release.open()
    await locker
    const response = await answer
    t.ok(Date.now() - started >= 400, 'the lock was held past the whole wait')
    t.equal(response.status, 200, 'the request ran: nobody held its key')
    t.equal(w.runs.count, 1)
    t.equal(await payments('locked-1'), 1)
  })
}
