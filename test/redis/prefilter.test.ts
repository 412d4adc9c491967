import { randomBytes } from 'node:crypto'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import { Cluster, Redis } from 'ioredis'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type IdempotencyStore } from '../../lib/index.js'
import type { IdempotencyPrefilter } from '../../lib/core/prefilter.js'
import { redisPrefilter } from '../../drivers/redis/index.js'
import { recordKey } from '../../drivers/redis/keys.js'
import { eventually } from '../helpers/app.js'
import { sleep } from '../helpers/sleep.js'
import { clusterNodes } from '../helpers/redis-nodes.js'

/**
 * The pre-filter in the request lifecycle, against real Redis servers (REDIS_URL and
 * REDIS_CLUSTER_NODES; `node scripts/test.mjs` provisions both). The store (memory, counted) stays
 * the only judge of who executes. Redis answers only from a completed copy (the store's committed
 * record); an in-flight marker never answers, it only lets a duplicate on a route that waits wait
 * without asking the store.
 */

const REDIS_URL = process.env.REDIS_URL
const CLUSTER = process.env.REDIS_CLUSTER_NODES
if (REDIS_URL === undefined || CLUSTER === undefined) {
  t.fail('REDIS_URL and REDIS_CLUSTER_NODES must be set: run `node scripts/test.mjs test/redis/prefilter.test.ts` (it starts throwaway Redis servers).')
} else {
  const nodes = clusterNodes(CLUSTER)
  // A database of its own: test files run in parallel on one server, and this one flushes it.
  suite('standalone', () => new Redis(REDIS_URL, { maxRetriesPerRequest: 1, db: 2 }))
  suite('cluster', () => new Cluster(nodes, { redisOptions: { maxRetriesPerRequest: 1 } }))
}

const keyed = (key: string): Record<string, string> => ({ 'idempotency-key': `"${key}"`, 'content-type': 'application/json' })

interface Counted extends IdempotencyStore { readonly calls: { claim: number, complete: number } }

/** A memory store that counts its round trips. */
function countedStore (): Counted {
  const inner = memoryStore({ purgeInterval: 0 })
  const calls = { claim: 0, complete: 0 }
  return {
    ...inner,
    calls,
    claim: async (request) => { calls.claim++; return inner.claim(request) },
    complete: async (lease, response, ttl) => { calls.complete++; return inner.complete(lease, response, ttl) }
  }
}

function suite (name: string, connect: () => Redis | Cluster): void {
  t.test(name, async (t) => {
    const client = connect()
    t.teardown(() => { client.disconnect() })

    async function world (t: Test, options: { delay?: number, wait?: number, prefilter?: IdempotencyPrefilter } = {}): Promise<{ app: FastifyInstance, store: Counted, runs: Map<string, number> }> {
      const store = countedStore()
      // The tests here count store calls: a timeout long enough that a busy machine's slow Redis
      // reply is not taken for an outage (a real outage fails at once; the slow case has its own test).
      const prefilter = options.prefilter ?? redisPrefilter({ client, prefix: `t${randomBytes(4).toString('hex')}`, timeout: 1000 })
      const app = Fastify()
      t.teardown(() => app.close())
      await app.register(idempotency, { store, prefilter, scope: () => 'tenant', wait: options.wait ?? 0 })
      const runs = new Map<string, number>()
      app.post('/pay', async (request, reply) => {
        const key = request.idempotency?.key ?? ''
        runs.set(key, (runs.get(key) ?? 0) + 1)
        if (options.delay !== undefined) await sleep(options.delay)
        return reply.code(201).header('location', `/pay/${key}`).send({ key, charge: randomBytes(6).toString('hex') })
      })
      return { app, store, runs }
    }
    const pay = (app: FastifyInstance, key: string, amount = 1): Promise<LightMyRequestResponse> =>
      app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: { amount } })

    /** Waits (bounded) for the fire-and-forget copy into Redis. */
    async function settled (): Promise<void> { await sleep(30) }

    /** Waits (bounded) until the handler for `key` runs: its claim is taken, and its marker set, by then. */
    async function started (runs: Map<string, number>, key: string): Promise<void> {
      for (let i = 0; i < 400 && runs.get(key) === undefined; i++) await sleep(5)
    }

    t.test('a completed record is replayed from Redis with zero store calls, byte-identical', async (t) => {
      const { app, store, runs } = await world(t)
      const first = await pay(app, 'k1')
      await settled()
      const claims = store.calls.claim
      const replay = await pay(app, 'k1')
      t.equal(store.calls.claim, claims, 'no store call for the replay')
      t.equal(replay.statusCode, 201)
      t.equal(replay.headers['idempotent-replayed'], 'true')
      t.equal(replay.body, first.body)
      t.equal(replay.headers.location, first.headers.location)
      t.equal(replay.headers['content-type'], first.headers['content-type'])
      t.equal(runs.get('k1'), 1)
      const mismatch = await pay(app, 'k1', 2)
      t.equal(mismatch.statusCode, 422, 'a different request gets 422 from the copy, as from the store')
      t.equal(store.calls.claim, claims)
    })

    t.test('a storm: 500 requests on 10 keys execute exactly 10 times; duplicates that wait rarely reach the store', async (t) => {
      const prefilter = redisPrefilter({ client, prefix: `t${randomBytes(4).toString('hex')}`, timeout: 1000 })
      const { app, store, runs } = await world(t, { delay: 250, wait: 5000, prefilter })
      const keys = Array.from({ length: 10 }, (_, i) => `storm-${i}`)
      const originals = keys.map((key) => pay(app, key))
      // The storm proper starts once the originals run and their in-flight markers are set.
      for (let i = 0; i < 100; i++) {
        const hits = await Promise.all(keys.map((key) => prefilter.lookup({ scope: 'tenant', key })))
        if (hits.every((hit) => hit !== null)) break
        await sleep(5)
      }
      const claimsBefore = store.calls.claim
      const answers = await Promise.all(keys.flatMap((key) => Array.from({ length: 49 }, () => pay(app, key))))
      await Promise.all(originals)
      const duplicateClaims = store.calls.claim - claimsBefore
      t.same([...runs.values()], Array(10).fill(1), 'exactly one execution per key')
      t.equal(answers.length, 490)
      t.ok(answers.every((a) => a.statusCode === 201 && a.headers['idempotent-replayed'] === 'true'), 'every duplicate gets the replay')
      t.ok(duplicateClaims < 49, `store round trips made by 490 waiting duplicates: ${duplicateClaims}`)
      t.comment(`storm (${name}): ${duplicateClaims} store claims for 490 duplicates`)
    })

    t.test('without wait, a duplicate of an original in flight is answered by the store, never by a marker', async (t) => {
      const { app, store, runs } = await world(t, { delay: 150 })
      const original = pay(app, 'nowait-1')
      await started(runs, 'nowait-1')
      const claims = store.calls.claim
      const duplicate = await pay(app, 'nowait-1')
      t.equal(duplicate.statusCode, 409, 'the store says in progress')
      t.equal(store.calls.claim, claims + 1, 'and was asked')
      t.equal((await original).statusCode, 201)
      t.equal(runs.get('nowait-1'), 1)
    })

    t.test('a flushed Redis falls through to the store: the replay is still right, nothing runs twice', async (t) => {
      const prefix = `t${randomBytes(4).toString('hex')}`
      const { app, store, runs } = await world(t, { prefilter: redisPrefilter({ client, prefix, timeout: 200 }) })
      const first = await pay(app, 'k2')
      await settled()
      if (client instanceof Redis) {
        await client.flushdb()
      } else {
        // The cluster has only database 0, shared with the files running beside this one: lose
        // everything of this test's instead.
        await Promise.all(client.nodes('master').map(async (node) => {
          const keys = await node.keys(`${prefix}:*`)
          if (keys.length > 0) await node.del(...keys)
        }))
      }
      const claims = store.calls.claim
      const replay = await pay(app, 'k2')
      t.equal(store.calls.claim, claims + 1, 'the store answered')
      t.equal(replay.body, first.body)
      t.equal(replay.headers['idempotent-replayed'], 'true')
      t.equal(runs.get('k2'), 1)
      await settled()
      const again = await pay(app, 'k2')
      t.equal(store.calls.claim, claims + 1, 'the record read from the store was copied back: no further store call')
      t.equal(again.body, first.body)
    })

    t.test('a stale in-flight marker never refuses a request: the store decides, at once or after the route\'s wait', async (t) => {
      const prefilter = redisPrefilter({ client, prefix: `t${randomBytes(4).toString('hex')}`, timeout: 200 })
      const { canonicalFingerprint } = await import('../../lib/core/fingerprint.js')
      const fingerprint = canonicalFingerprint('POST', '/pay', { amount: 1 }, 'application/json')
      // Markers left by owners that died without completing (the store has no record).
      await prefilter.markInFlight({ scope: 'tenant', key: 'stale-1' }, fingerprint, 5000)
      await prefilter.markInFlight({ scope: 'tenant', key: 'stale-2' }, fingerprint, 5000)
      const plain = await world(t, { prefilter })
      const atOnce = await pay(plain.app, 'stale-1')
      t.equal(atOnce.statusCode, 201, 'no wait: the store let it execute at once')
      const waiting = await world(t, { prefilter, wait: 100 })
      const started = Date.now()
      const afterWait = await pay(waiting.app, 'stale-2')
      t.equal(afterWait.statusCode, 201, 'with wait: the store let it execute once the wait ran out')
      t.ok(Date.now() - started < 2000, 'the marker delayed it by at most the wait, not the marker\'s ttl')
      t.equal(plain.runs.get('stale-1'), 1)
      t.equal(waiting.runs.get('stale-2'), 1)
    })

    t.test('a pre-filter that fails or is slow never fails a request and never causes a second execution', async (t) => {
      const broken: IdempotencyPrefilter = {
        lookup: async () => { throw new Error('redis down') },
        markInFlight: async () => { throw new Error('redis down') },
        clearInFlight: async () => { throw new Error('redis down') },
        remember: async () => { throw new Error('redis down') },
        close: async () => {}
      }
      const slow: IdempotencyPrefilter = {
        lookup: () => new Promise((resolve, reject) => setTimeout(() => reject(new Error('timeout')), 60)),
        markInFlight: async () => {},
        clearInFlight: async () => {},
        remember: async () => {},
        close: async () => {}
      }
      for (const prefilter of [broken, slow]) {
        const { app, runs } = await world(t, { prefilter })
        const first = await pay(app, 'k4')
        t.equal(first.statusCode, 201)
        const again = await Promise.all([pay(app, 'k4'), pay(app, 'k4')])
        t.same(again.map((a) => a.statusCode), [201, 201])
        t.ok(again.every((a) => a.body === first.body && a.headers['idempotent-replayed'] === 'true'))
        t.equal(runs.get('k4'), 1)
      }
    })

    t.test('a fresh key costs one Redis round trip before the store; on a route that waits, its marker is set by the same script', async (t) => {
      const inner = redisPrefilter({ client, prefix: `t${randomBytes(4).toString('hex')}`, timeout: 200 })
      const calls: string[] = []
      const prefilter: IdempotencyPrefilter = {
        lookup: async (id) => { calls.push('lookup'); return await inner.lookup(id) },
        lookupOrMark: async (id, fingerprint, ttl) => { calls.push('lookupOrMark'); return await (inner.lookupOrMark as NonNullable<IdempotencyPrefilter['lookupOrMark']>)(id, fingerprint, ttl) },
        markInFlight: async (id, fingerprint, ttl) => { calls.push('markInFlight'); await inner.markInFlight(id, fingerprint, ttl) },
        clearInFlight: async (id) => { calls.push('clearInFlight'); await inner.clearInFlight(id) },
        remember: async (id, fingerprint, response, ttl) => { calls.push('remember'); await inner.remember(id, fingerprint, response, ttl) },
        close: async () => { await inner.close() }
      }
      const plain = await world(t, { prefilter })
      t.equal((await pay(plain.app, 'fresh-0')).statusCode, 201)
      await settled()
      t.same(calls.splice(0), ['lookup', 'remember'], 'no wait: one look, then the copy; no marker is written')

      const { app, store, runs } = await world(t, { delay: 150, wait: 2000, prefilter })
      const original = pay(app, 'fresh-1')
      await started(runs, 'fresh-1')
      const claims = store.calls.claim
      const duplicate = await pay(app, 'fresh-1')
      t.equal(duplicate.statusCode, 201, 'a duplicate while the original runs waits for it')
      t.equal(duplicate.headers['idempotent-replayed'], 'true', 'and gets the replay')
      t.equal(store.calls.claim, claims, 'without asking the store')
      t.equal((await original).statusCode, 201)
      await settled()
      t.equal(calls[0], 'lookupOrMark', 'the original: one look that also marked it')
      t.equal(calls.filter((call) => call === 'remember').length, 1, 'then the copy')
      t.notOk(calls.includes('markInFlight'), 'no separate markInFlight')
      t.equal(runs.get('fresh-1'), 1)
    })

    t.test('a completed key whose copy is gone: concurrent retries all get the replay (a marker set before asking the store refuses none)', async (t) => {
      for (const wait of [0, 2000]) {
        const prefix = `t${randomBytes(4).toString('hex')}`
        const { app, runs } = await world(t, { wait, prefilter: redisPrefilter({ client, prefix, timeout: 1000 }) })
        const key = `gone-${wait}`
        const first = await pay(app, key)
        await settled()
        const nodes = client instanceof Redis ? [client] : client.nodes('master')
        await Promise.all(nodes.map(async (node) => {
          const found = await node.keys(`${prefix}:*`)
          if (found.length > 0) await node.del(...found)
        }))
        const retries = await Promise.all(Array.from({ length: 8 }, () => pay(app, key)))
        t.same(retries.map((r) => r.statusCode), Array(8).fill(201), `wait ${wait}: every retry is answered 201, none 409`)
        t.ok(retries.every((r) => r.headers['idempotent-replayed'] === 'true' && r.body === first.body), `wait ${wait}: each is the replay`)
        t.equal(runs.get(key), 1)
      }
    })

    t.test('an in-flight marker of another request is left to the store: the reuse gets its 422 from the store', async (t) => {
      const { app, store, runs } = await world(t, { delay: 150 })
      const original = pay(app, 'reused-1', 1)
      await started(runs, 'reused-1')
      const claims = store.calls.claim
      const other = await pay(app, 'reused-1', 2)
      t.equal(other.statusCode, 422)
      t.equal(store.calls.claim, claims + 1, 'the store answered it')
      t.equal((await original).statusCode, 201)
      t.equal(runs.get('reused-1'), 1)
    })

    t.test('a marker set by the first look goes when the store does not hand the key over', async (t) => {
      const prefix = `t${randomBytes(4).toString('hex')}`
      const prefilter = redisPrefilter({ client, prefix, timeout: 200 })
      const { app, runs } = await world(t, { delay: 300, wait: 50, prefilter })
      const original = pay(app, 'not-mine')
      await started(runs, 'not-mine')
      // The original's marker is lost (an eviction). Not through clearInFlight: a request clears
      // only its own marker, and this RecordId is not the original's.
      await client.del(recordKey(prefix, { scope: 'tenant', key: 'not-mine' }))
      const duplicate = await pay(app, 'not-mine')
      t.equal(duplicate.statusCode, 409, 'the store says in progress (after the route\'s wait)')
      await settled()
      t.equal(await prefilter.lookup({ scope: 'tenant', key: 'not-mine' }), null, 'the duplicate\'s own marker did not stay')
      t.equal((await original).statusCode, 201)
      await settled()
      t.equal((await prefilter.lookup({ scope: 'tenant', key: 'not-mine' }))?.state, 'completed', 'the original\'s copy is there')
      t.equal(runs.get('not-mine'), 1)
    })

    t.test('a released key clears its marker: the retry executes at once', async (t) => {
      const { app } = await world(t, { wait: 1000 })
      let runs = 0
      app.post('/fail', async () => { runs++; throw new Error('boom') })
      const failed = await app.inject({ method: 'POST', url: '/fail', headers: keyed('k5'), payload: {} })
      t.equal(failed.statusCode, 500)
      await settled()
      const started = Date.now()
      const retry = await app.inject({ method: 'POST', url: '/fail', headers: keyed('k5'), payload: {} })
      t.equal(retry.statusCode, 500, 'not 409: the marker went with the release')
      t.ok(Date.now() - started < 500, 'and the retry did not wait on it')
      t.equal(runs, 2)
    })
  })
}

t.test('Redis stopped in the middle of a storm and restarted: one execution per key, every answer consistent', async (t) => {
  const { spawn, execFileSync } = await import('node:child_process')
  const { mkdtempSync, rmSync } = await import('node:fs')
  const { tmpdir } = await import('node:os')
  const { join } = await import('node:path')
  const { createServer } = await import('node:net')
  const port = await new Promise<number>((resolve) => {
    const probe = createServer().listen(0, '127.0.0.1', () => {
      const address = probe.address()
      probe.close(() => resolve(typeof address === 'object' && address !== null ? address.port : 0))
    })
  })
  const dir = mkdtempSync(join(tmpdir(), 'idem-redis-restart-'))
  const bin = process.env.REDIS_SERVER_BIN ?? 'redis-server'
  const start = async (): Promise<void> => {
    spawn(bin, ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--dir', dir, '--daemonize', 'yes', '--logfile', join(dir, 'redis.log')], { stdio: 'ignore' })
    const probe = new Redis(port, '127.0.0.1', { lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null })
    for (let i = 0; i < 200; i++) {
      try { await probe.connect(); await probe.ping(); break } catch { await sleep(20) }
    }
    probe.disconnect()
  }
  const stop = (): void => { try { execFileSync('redis-cli', ['-p', String(port), 'shutdown', 'nosave'], { stdio: 'ignore' }) } catch {} }
  t.teardown(() => { stop(); rmSync(dir, { recursive: true, force: true }) })
  await start()

  const client = new Redis(port, '127.0.0.1', { maxRetriesPerRequest: 0, enableOfflineQueue: false, retryStrategy: () => 20 })
  client.on('error', () => {})
  t.teardown(() => { client.disconnect() })
  const store = countedStore()
  const app = Fastify()
  t.teardown(() => app.close())
  // A stopped Redis fails at once (no offline queue), so the timeout only bounds a slow answer: 1 s,
  // so that a loaded machine's slow Redis replies are not taken for an outage (with 50 ms, a storm of
  // 200 requests on a busy CI machine sent some to the store after the copies were back).
  const prefilter = redisPrefilter({ client, timeout: 1000 })
  await app.register(idempotency, { store, prefilter, scope: () => 'tenant' })
  const runs = new Map<string, number>()
  app.post('/pay', async (request) => {
    const key = request.idempotency?.key ?? ''
    runs.set(key, (runs.get(key) ?? 0) + 1)
    await sleep(20)
    return { key, charge: randomBytes(6).toString('hex') }
  })

  const keys = Array.from({ length: 10 }, (_, i) => `restart-${i}`)
  const bodies = new Map<string, Set<string>>(keys.map((key) => [key, new Set()]))
  let failures = 0
  const retryingClient = async (key: string): Promise<void> => {
    for (let attempt = 0; attempt < 400; attempt++) {
      const answer = await app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: {} })
      if (answer.statusCode === 409) { await sleep(10); continue }
      if (answer.statusCode !== 200) failures++
      bodies.get(key)?.add(answer.body)
      return
    }
  }
  const storm = async (): Promise<void> => { await Promise.all(keys.flatMap((key) => Array.from({ length: 20 }, () => retryingClient(key)))) }
  const first = storm()
  await sleep(10)
  stop()
  await first
  await storm()
  await start()
  await sleep(100)
  await storm() // Redis is back but empty: the store answers, and its records are copied back in
  for (let i = 0; i < 100; i++) {
    const hits = await Promise.all(keys.map((key) => prefilter.lookup({ scope: 'tenant', key }).catch(() => null)))
    if (hits.every((hit) => hit?.state === 'completed')) break
    await sleep(10)
  }
  const claims = store.calls.claim
  await storm()
  t.equal(store.calls.claim, claims, 'once the copies are back, the storm is answered from Redis alone')
  t.equal(failures, 0, 'no request failed because Redis went away')
  t.same(keys.map((key) => runs.get(key)), Array(10).fill(1), 'exactly one execution per key')
  t.ok([...bodies.values()].every((set) => set.size === 1), 'every client of a key got the same body')
  const stats = prefilter.stats
  t.ok(stats.failures > 0, `the outage was counted (${stats.failures} operations fell through to the store)`)
  t.ok(stats.hits > 0, `after the restart Redis answered again (${stats.hits} hits)`)
})

t.test('with the Postgres store, a record the store replays is copied back into Redis, never outliving it', async (t) => {
  const url = process.env.DATABASE_URL
  if (url === undefined || REDIS_URL === undefined) return t.fail('DATABASE_URL and REDIS_URL must be set')
  const { default: postgres } = await import('postgres')
  const { postgresStore } = await import('../../drivers/postgres/index.js')
  const schema = `idem_pf_${randomBytes(4).toString('hex')}`
  const sql = postgres(url, { max: 4, onnotice: () => {} })
  const redis = new Redis(REDIS_URL, { db: 3 })
  t.teardown(async () => {
    await sql`DROP SCHEMA IF EXISTS ${sql(schema)} CASCADE`
    await sql.end({ timeout: 2 })
    redis.disconnect()
  })
  const inner = postgresStore({ sql, schema, purgeInterval: 0 })
  await inner.migrate()
  let claims = 0
  const store: IdempotencyStore = { ...inner, claim: async (request) => { claims++; return inner.claim(request) } }
  const prefix = `t${randomBytes(4).toString('hex')}`
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store, prefilter: redisPrefilter({ client: redis, prefix }), scope: () => 'tenant', ttl: 60_000 })
  app.post('/pay', async () => ({ charge: randomBytes(6).toString('hex') }))
  const first = await app.inject({ method: 'POST', url: '/pay', headers: keyed('pg-1'), payload: {} })
  await sleep(30)
  await redis.flushdb()
  const fromStore = await app.inject({ method: 'POST', url: '/pay', headers: keyed('pg-1'), payload: {} })
  t.equal(fromStore.body, first.body)
  t.equal(claims, 2)
  // The copy is written after the answer, without holding it: on a loaded machine it takes a while.
  let keys: string[] = []
  await eventually(async () => (keys = await redis.keys(`${prefix}:*`)).length > 0)
  t.equal(keys.length, 1, 'the record was copied back')
  const ttl = await redis.pttl(keys[0] ?? '')
  t.ok(ttl > 0 && ttl <= 60_000 - 1000, `its Redis TTL (${ttl} ms) ends before the store's record expires`)
  const fromRedis = await app.inject({ method: 'POST', url: '/pay', headers: keyed('pg-1'), payload: {} })
  t.equal(fromRedis.body, first.body)
  t.equal(claims, 2, 'answered from Redis')
})
