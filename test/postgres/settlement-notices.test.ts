import Fastify, { type FastifyInstance } from 'fastify'
import { Redis } from 'ioredis'
import t, { type Test } from 'tap'
import idempotency, { settlementDigest, type IdempotencyStore } from '../../lib/index.js'
import { postgresStore, type BackgroundTask, type PostgresStore } from '../../drivers/postgres/index.js'
import { redisPrefilter, type RedisPrefilter } from '../../drivers/redis/index.js'
import { settlementChannel } from '../../drivers/postgres/settlements.js'
import { CLIENT_NAME, endPools, storeConnection } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Duplicates that wait (the `wait` option) across instances are woken by the original's
 * settlement through LISTEN/NOTIFY, not by a poll: two apps, each with a store of its own on the
 * same table, the way two instances share a database. A waiter makes two claims (the one that found
 * the key in progress, the one after the notice) however long the original runs, while the
 * lease, after which it would otherwise look again, is 60 s. The store runs on the client under test
 * (test/helpers/postgres-clients.ts; the node-postgres run:
 * test/postgres/node-postgres/settlement-notices.test.ts).
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/settlement-notices.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const applicationName = `idem-notices-${process.pid}`
  const { name: schema, sql } = postgresSchema(t, url, { prefix: 'idem_notices', client: { max: 10, connection: { application_name: applicationName } } })
  const listenerName = `${applicationName} (idempotency listener)`
  let tables = 0
  t.teardown(endPools)

  interface Instance {
    readonly app: FastifyInstance
    readonly store: PostgresStore
    /** Claims this instance sent to its store. */
    claims: number
    readonly background: Array<[BackgroundTask, string]>
    readonly prefilter: RedisPrefilter | null
  }

  interface World {
    readonly table: string
    readonly runs: { count: number }
    /** The handler's behaviour per run: how long it takes, and whether it throws. */
    plan: Array<{ ms: number, fail?: boolean }>
    readonly instances: Instance[]
    post (instance: Instance, key: string): Promise<{ status: number, replayed: boolean, body: string, at: number }>
  }

  async function world (t: Test, options: { wait: number, instances?: number, redis?: Redis }): Promise<World> {
    const table = `records_${++tables}`
    const prefix = `notices-${process.pid}-${tables}`
    const runs = { count: 0 }
    const w: World = {
      table,
      runs,
      plan: [],
      instances: [],
      async post (instance, key) {
        const response = await instance.app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': `"${key}"` }, payload: { amount: 1 } })
        return { status: response.statusCode, replayed: response.headers['idempotent-replayed'] === 'true', body: response.body, at: Date.now() }
      }
    }
    for (let i = 0; i < (options.instances ?? 2); i++) {
      const background: Array<[BackgroundTask, string]> = []
      const store = postgresStore({ ...storeConnection(sql), schema, table, purgeInterval: 0, onBackgroundError: (err, task) => { background.push([task, String(err)]) } })
      if (i === 0) await store.migrate()
      const counted: IdempotencyStore = { ...store, claim: (request) => { instance.claims++; return store.claim(request) } }
      const app = Fastify()
      const prefilter = options.redis === undefined ? null : redisPrefilter({ client: options.redis, prefix, timeout: 1_000 })
      await app.register(idempotency, { store: counted, ...(prefilter === null ? {} : { prefilter }), scope: () => 'acct', lease: 60_000, wait: options.wait })
      app.post('/pay', async () => {
        const step = w.plan[runs.count] ?? { ms: 0 }
        const run = ++runs.count
        await sleep(step.ms)
        if (step.fail === true) throw new Error('the provider timed out')
        return { run }
      })
      await app.ready()
      const instance: Instance = { app, store, claims: 0, background, prefilter }
      w.instances.push(instance)
      t.teardown(async () => { await app.close(); await store.close() })
    }
    // Each instance's first waiting route opens its watch: a request each, then until every listener is in place.
    if (options.wait > 0) {
      for (const [i, instance] of w.instances.entries()) await w.post(instance, `warm-up-${i}`)
      await listeners(w.instances.length)
    }
    for (const instance of w.instances) instance.claims = 0
    runs.count = 0
    return w
  }

  /** Until `count` listening connections of this test are idle after their LISTEN (5 s at most). */
  async function listeners (count: number): Promise<number[]> {
    let pids: number[] = []
    for (let i = 0; i < 500; i++) {
      pids = (await sql<Array<{ pid: number }>>`
        SELECT pid FROM pg_stat_activity WHERE application_name = ${listenerName} AND state = 'idle' AND query ILIKE 'LISTEN%'`).map((row) => row.pid)
      if (pids.length === count) break
      await sleep(10)
    }
    // The client resolves the LISTEN right after the server answered it.
    await sleep(20)
    return pids
  }

  /** Once the key's record is in progress: the original has claimed it. */
  async function claimed (table: string, key: string): Promise<void> {
    for (let i = 0; i < 500; i++) {
      const rows = await sql`SELECT 1 FROM ${sql(schema)}.${sql(table)} WHERE key = ${key} AND state = 'in_progress'`
      if (rows.length > 0) return
      await sleep(5)
    }
    throw new Error(`${key} was never claimed`)
  }

  t.test(`a duplicate on another instance is answered when the original settles, with two claims (${CLIENT_NAME})`, async (t) => {
    const w = await world(t, { wait: 20_000 })
    const [a, b] = w.instances as [Instance, Instance]
    w.plan = [{ ms: 600 }]
    const original = w.post(a, 'pay-1')
    await claimed(w.table, 'pay-1')
    const duplicate = await w.post(b, 'pay-1')
    const first = await original
    t.equal(w.runs.count, 1, 'the handler ran once')
    t.match(first, { status: 200, replayed: false })
    t.match(duplicate, { status: 200, replayed: true, body: first.body }, 'the duplicate got the replay')
    t.equal(b.claims, 2, 'the waiter claimed twice: once before waiting, once when woken')
    t.ok(duplicate.at - first.at < 1_000, `answered ${duplicate.at - first.at} ms after the original, not at its lease's end (60 s)`)
  })

  t.test(`a released original lets exactly one waiter run; the others get its replay (${CLIENT_NAME})`, async (t) => {
    const w = await world(t, { wait: 20_000 })
    const [a, b] = w.instances as [Instance, Instance]
    w.plan = [{ ms: 400, fail: true }, { ms: 300 }]
    const original = w.post(a, 'pay-2')
    await claimed(w.table, 'pay-2')
    const duplicates = await Promise.all([a, a, b, b, b].map((instance) => w.post(instance, 'pay-2')))
    t.equal((await original).status, 500, 'the original failed and released the key')
    t.equal(w.runs.count, 2, 'the handler ran twice: the original, and one waiter')
    t.same(duplicates.map((d) => d.status), [200, 200, 200, 200, 200], 'every waiter was answered 200')
    t.equal(duplicates.filter((d) => !d.replayed).length, 1, 'one waiter ran the operation')
    t.equal(new Set(duplicates.map((d) => d.body)).size, 1, 'and the others got its response')
    // Each waiter claims when it arrives, when the release wakes it and when the completion does:
    // 9 in all (a read every 2 s in case a notice was lost may add one on a slow machine); polling
    // every 10 to 250 ms instead makes about 24.
    t.ok(b.claims <= 12, `instance b: ${b.claims} claims for 3 waiters`)
  })

  t.test(`a lost listener connection is reported, waiters poll meanwhile, and it listens again (${CLIENT_NAME})`, async (t) => {
    const w = await world(t, { wait: 20_000 })
    const [a, b] = w.instances as [Instance, Instance]
    const before = await listeners(2)
    await sql`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid IN ${sql(before)}`
    // Each instance reports its loss, then listens again on a new connection.
    for (let i = 0; i < 500 && w.instances.some((instance) => !instance.background.some(([task]) => task === 'listener')); i++) await sleep(10)
    for (const instance of w.instances) t.ok(instance.background.some(([task]) => task === 'listener'), 'the loss was reported as task "listener"')
    const after = await listeners(2)
    t.equal(after.length, 2, 'both listen again')
    t.notOk(after.some((pid) => before.includes(pid)), 'on new connections')
    w.plan = [{ ms: 600 }]
    const original = w.post(a, 'pay-3')
    await claimed(w.table, 'pay-3')
    const duplicate = await w.post(b, 'pay-3')
    const first = await original
    t.match(duplicate, { status: 200, replayed: true, body: first.body })
    t.equal(b.claims, 2, 'woken by the notice again: two claims')
  })

  t.test(`while the listener is down, a waiter polls and is still answered (${CLIENT_NAME})`, async (t) => {
    const w = await world(t, { wait: 20_000 })
    const [a, b] = w.instances as [Instance, Instance]
    w.plan = [{ ms: 800 }]
    const original = w.post(a, 'pay-4')
    await claimed(w.table, 'pay-4')
    const duplicate = w.post(b, 'pay-4')
    await sleep(100)
    // b's listener goes while its duplicate waits for a notice: b is told, and polls.
    await sql`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = ${listenerName}`
    const [first, second] = await Promise.all([original, duplicate])
    t.match(second, { status: 200, replayed: true, body: first.body }, 'answered with the replay')
    t.ok(second.at - first.at < 1_000, `${second.at - first.at} ms after the original`)
    t.equal(w.runs.count, 1)
  })

  t.test(`a settlement is noticed only when someone may wait for it (${CLIENT_NAME})`, async (t) => {
    const seen: string[] = []
    const channel = settlementChannel(schema, `records_${tables + 1}`)
    const listening = await sql.listen(channel, (payload) => { seen.push(payload) })
    t.teardown(() => listening.unlisten())
    const waiting = await world(t, { wait: 5_000, instances: 1 })
    const [instance] = waiting.instances as [Instance]
    seen.length = 0
    await waiting.post(instance, 'noticed')
    for (let i = 0; i < 200 && seen.length === 0; i++) await sleep(10)
    t.same(seen, [settlementDigest('acct', 'noticed')], 'the completion was noticed, by its digest (never the key)')

    const quiet = await world(t, { wait: 0, instances: 1 })
    const channelOfQuiet = settlementChannel(schema, quiet.table)
    const heard: string[] = []
    const other = await sql.listen(channelOfQuiet, (payload) => { heard.push(payload) })
    t.teardown(() => other.unlisten())
    await quiet.post(quiet.instances[0] as Instance, 'quiet')
    await sleep(200)
    t.same(heard, [], 'a route that does not wait sends no notice')
  })

  t.test(`with the Redis pre-filter, a duplicate waits on the original's marker until the settlement wakes it (${CLIENT_NAME})`, async (t) => {
    const redisUrl = process.env.REDIS_URL
    if (redisUrl === undefined) return t.fail('REDIS_URL must be set (node scripts/test.mjs sets it)')
    // A database of its own: other test files share the server and flush theirs.
    const redis = new Redis(redisUrl, { maxRetriesPerRequest: 1, db: 5 })
    t.teardown(() => { redis.disconnect() })
    const w = await world(t, { wait: 20_000, redis })
    const [a, b] = w.instances as [Instance, Instance]
    w.plan = [{ ms: 800 }]
    const original = w.post(a, 'pay-5')
    await claimed(w.table, 'pay-5')
    const before = b.prefilter?.stats as NonNullable<Instance['prefilter']>['stats']
    const duplicate = await w.post(b, 'pay-5')
    const first = await original
    const after = b.prefilter?.stats as NonNullable<Instance['prefilter']>['stats']
    t.match(duplicate, { status: 200, replayed: true, body: first.body }, 'the duplicate got the replay')
    t.equal(w.runs.count, 1)
    t.ok(duplicate.at - first.at < 1_000, `answered ${duplicate.at - first.at} ms after the original`)
    // Its first look found the marker; woken by the settlement, its second found the copy (or, not
    // written yet, the marker: then the store answered). Polling Redis every 10 to 250 ms through
    // the original's 800 ms would have looked about 8 times.
    const looks = after.hits + after.misses - before.hits - before.misses
    t.ok(looks <= 3, `${looks} pre-filter lookups`)
    t.ok(b.claims <= 1, `${b.claims} store claims`)
  })
}
