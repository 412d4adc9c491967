import { randomUUID } from 'node:crypto'
import Fastify, { type FastifyInstance } from 'fastify'
import { Cluster, Redis } from 'ioredis'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, settlementDigest, type ClaimRequest, type IdempotencyStore } from '../../lib/index.js'
import { redisPrefilter, type RedisPrefilter } from '../../drivers/redis/index.js'
import { gatedHandler } from '../helpers/gated-handler.js'
import { clusterNodes } from '../helpers/redis-nodes.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The Redis pre-filter's settlement notices: an owner's in-flight marker replaced by its completed
 * copy, or cleared when it gives the key back, is published, and duplicates waiting on another
 * instance are woken by it rather than by a poll. The store here (one memory store shared by two
 * apps, as two instances share a database) has no notices of its own, so whatever wakes a waiter
 * on the other instance before its 2 s read is the pre-filter's notice.
 */

const REDIS_URL = process.env.REDIS_URL
if (REDIS_URL === undefined || REDIS_URL === '') {
  t.fail('REDIS_URL is not set: run `node scripts/test.mjs test/redis/settlement-notices.test.ts` (it starts a throwaway Redis).')
} else {
  suite(REDIS_URL)
}

function suite (url: string): void {
  // Database 6: no test file flushes it (test/structure/redis-databases.test.ts); keys are this run's own prefix.
  // Named, so that the subscriber it is duplicated into can be found among other files' connections.
  const connectionName = `notices-${process.pid}`
  const redis = new Redis(url, { db: 6, maxRetriesPerRequest: 1, connectionName })
  t.teardown(() => redis.disconnect())

  interface Instance {
    readonly app: FastifyInstance
    readonly prefilter: RedisPrefilter
    /** Claims this instance sent to the shared store. */
    claims: number
  }

  interface World {
    readonly instances: [Instance, Instance]
    readonly runs: () => number
    /** Lets the handler in flight answer, or fail (the key is released). */
    finish (fail?: boolean): void
  }

  async function world (t: Test): Promise<World> {
    const store = memoryStore({ purgeInterval: 0 })
    t.teardown(() => store.close())
    const prefix = `notices-${randomUUID()}`
    const gated = gatedHandler()
    const instances: Instance[] = []
    for (let i = 0; i < 2; i++) {
      const prefilter = redisPrefilter({ client: redis, prefix, timeout: 1_000 })
      const counted: IdempotencyStore = {
        ...store,
        claim: (request: ClaimRequest) => {
          instance.claims++
          return store.claim(request)
        }
      }
      const app = Fastify()
      t.teardown(() => app.close())
      await app.register(idempotency, { store: counted, prefilter, scope: () => 'acct', lease: 60_000, wait: 10_000 })
      app.post('/pay', gated.handler)
      await app.ready()
      const instance: Instance = { app, prefilter, claims: 0 }
      instances.push(instance)
    }
    // A first request on each instance opens its watch (at the first claim of a route with wait).
    for (const [i, instance] of instances.entries()) {
      const warm = pay(instance, `warm-up-${i}`)
      await until(() => gated.runs() > i)
      gated.finish()
      await warm
      instance.claims = 0
    }
    await sleep(100)
    const warmUps = gated.runs()
    return { instances: instances as [Instance, Instance], runs: () => gated.runs() - warmUps, finish: gated.finish }
  }

  const pay = async (instance: Instance, key = 'k'): Promise<{ status: number, replayed: boolean, at: number }> => {
    const response = await instance.app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': `"${key}"` }, payload: {} })
    return { status: response.statusCode, replayed: response.headers['idempotent-replayed'] === 'true', at: Date.now() }
  }

  async function until (condition: () => boolean): Promise<void> {
    for (let i = 0; i < 400 && !condition(); i++) await sleep(5)
  }

  t.test('a duplicate on another instance is woken by the completed copy\'s notice and replays it, without polling', async (t) => {
    const w = await world(t)
    const [a, b] = w.instances
    const original = pay(a)
    await until(() => w.runs() === 1)
    // The duplicate's first look finds the original's marker, then waits on it.
    const duplicate = pay(b)
    await sleep(400)
    const looksBefore = b.prefilter.stats.hits + b.prefilter.stats.misses
    w.finish()
    const first = await original
    const answer = await duplicate
    t.equal(first.status, 200)
    t.equal(answer.status, 200)
    t.ok(answer.replayed, 'the replay')
    t.ok(answer.at - first.at < 1_000, `answered ${answer.at - first.at} ms after the original, not at its 2 s read`)
    t.equal(w.runs(), 1)
    t.equal(b.claims, 0, 'answered from the copy: the store was not asked')
    // Without notices, it would have looked every 10 to 250 ms while it waited.
    t.ok(looksBefore <= 2, `${looksBefore} pre-filter lookups while it waited`)
  })

  t.test('a released original: the cleared marker\'s notice wakes a duplicate on another instance, which runs the operation', async (t) => {
    const w = await world(t)
    const [a, b] = w.instances
    const original = pay(a)
    await until(() => w.runs() === 1)
    const duplicate = pay(b)
    await sleep(300)
    const releasedAt = Date.now()
    w.finish(true)
    t.equal((await original).status, 500)
    await until(() => w.runs() === 2)
    t.ok(Date.now() - releasedAt < 1_000, `the duplicate ran ${Date.now() - releasedAt} ms after the release, not at its 2 s read`)
    w.finish()
    const answer = await duplicate
    t.equal(answer.status, 200)
    t.notOk(answer.replayed, 'its own run')
    t.equal(w.runs(), 2)
  })

  t.test('the watch: a notice per settled marker, none for a copy written over no marker; a killed connection goes and comes back', async (t) => {
    const prefix = `watch-${randomUUID()}`
    const prefilter = redisPrefilter({ client: redis, prefix, timeout: 1_000 })
    const settled: string[] = []
    const live: boolean[] = []
    const stop = prefilter.watchSettlements?.({ settled: (digest) => settled.push(digest), live: (flowing) => live.push(flowing) })
    t.teardown(() => stop?.())
    await until(() => live.length > 0)
    await sleep(50) // the SUBSCRIBE goes out right after 'ready'
    t.same(live, [true], 'in place')
    const fingerprint = { algorithm: 'test', digest: Buffer.alloc(32, 1) }
    const response = { statusCode: 201, headers: {}, body: Buffer.from('ok') }
    const marked = { scope: 'acct', key: 'marked' }
    await prefilter.markInFlight(marked, fingerprint, 10_000)
    await prefilter.remember(marked, fingerprint, response, 10_000)
    const released = { scope: 'acct', key: 'released' }
    await prefilter.markInFlight(released, fingerprint, 10_000)
    await prefilter.clearInFlight(released)
    await prefilter.remember({ scope: 'acct', key: 'unmarked' }, fingerprint, response, 10_000)
    await until(() => settled.length >= 2)
    await sleep(50)
    t.same(settled, [settlementDigest('acct', 'marked'), settlementDigest('acct', 'released')], 'the two settled markers, and nothing for the copy without one')

    // The subscriber's connection, killed as a failover or a network fault would end it.
    const clients = String(await redis.call('CLIENT', 'LIST', 'TYPE', 'pubsub')).split('\n')
    const ids = clients.filter((line) => line.includes(` name=${connectionName} `)).map((line) => /\bid=(\d+)/.exec(line)?.[1])
    t.equal(ids.length, 1, 'one subscriber of ours')
    for (const id of ids) await redis.call('CLIENT', 'KILL', 'ID', String(id))
    await until(() => live.length >= 3)
    t.same(live, [true, false, true], 'lost, then back')
    await sleep(50)
    const again = { scope: 'acct', key: 'again' }
    await prefilter.markInFlight(again, fingerprint, 10_000)
    await prefilter.remember(again, fingerprint, response, 10_000)
    await until(() => settled.length >= 3)
    t.equal(settled[2], settlementDigest('acct', 'again'), 'notices flow again after the reconnection')
  })

  t.test('on a Redis Cluster: a settled marker\'s notice reaches a subscriber on another node\'s connection', async (t) => {
    const nodes = process.env.REDIS_CLUSTER_NODES
    if (nodes === undefined || nodes === '') return t.fail('REDIS_CLUSTER_NODES is not set (node scripts/test.mjs starts a cluster)')
    const cluster = new Cluster(clusterNodes(nodes))
    t.teardown(() => cluster.disconnect())
    const prefilter = redisPrefilter({ client: cluster, prefix: `cluster-${randomUUID()}`, timeout: 1_000 })
    const settled: string[] = []
    const live: boolean[] = []
    const stop = prefilter.watchSettlements?.({ settled: (digest) => settled.push(digest), live: (flowing) => live.push(flowing) })
    t.teardown(() => stop?.())
    await until(() => live.includes(true))
    await sleep(100)
    const fingerprint = { algorithm: 'test', digest: Buffer.alloc(32, 1) }
    // Keys spread over the slots, so the scripts run on every master while one connection subscribes.
    const ids = Array.from({ length: 6 }, (_, i) => ({ scope: 'acct', key: `k${i}` }))
    for (const id of ids) {
      await prefilter.markInFlight(id, fingerprint, 10_000)
      await prefilter.remember(id, fingerprint, { statusCode: 201, headers: {}, body: null }, 10_000)
    }
    await until(() => settled.length >= ids.length)
    t.same(settled.sort(), ids.map((id) => settlementDigest(id.scope, id.key)).sort(), 'one notice per settled marker, from every master')
  })
}
