import type { FastifyInstance, FastifyReply, FastifyRequest, LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import { memoryStore } from '../../lib/index.js'
import { buildApp, deferred, keyed, manualClock } from '../helpers/app.js'

/**
 * Behaviour 11: a record is retained for `ttl` ms counted from its completion; after that the same
 * key executes as new. Expired records are purged without getting in the way of claims.
 */

const TTL = 60_000
const BODY = { amount: 10 }

function post (app: FastifyInstance, url: string, key: string): Promise<LightMyRequestResponse> {
  return app.inject({ method: 'POST', url, headers: keyed(key), payload: BODY })
}

async function setup (t: Test, plugin: Record<string, unknown> = {}) {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0 })
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store, ttl: TTL, ...plugin } })
  const counts = new Map<string, number>()
  const count = (url: string): number => counts.get(url) ?? 0
  const handler = (url: string) => async (_request: FastifyRequest, reply: FastifyReply) => {
    counts.set(url, count(url) + 1)
    reply.code(201)
    return { url, execution: count(url) }
  }
  return { clock, store, app, count, handler }
}

t.test('a retry one millisecond before the ttl replays; at the ttl the key executes as new', async (t) => {
  const { clock, app, count, handler } = await setup(t)
  app.post('/pay', handler('/pay'))

  const first = await post(app, '/pay', 'ttl-1')
  t.equal(first.statusCode, 201)

  clock.advance(TTL - 1)
  const replay = await post(app, '/pay', 'ttl-1')
  t.equal(replay.statusCode, 201)
  t.equal(replay.headers['idempotent-replayed'], 'true', 'at ttl − 1 ms: replayed')
  t.equal(replay.body, first.body)
  t.equal(count('/pay'), 1)

  clock.advance(1)
  const fresh = await post(app, '/pay', 'ttl-1')
  t.equal(fresh.statusCode, 201)
  t.equal(fresh.headers['idempotent-replayed'], undefined, 'at ttl: no replay header')
  t.match(JSON.parse(fresh.body), { execution: 2 }, 'a new execution')
  t.equal(count('/pay'), 2, 'the handler ran again')

  const again = await post(app, '/pay', 'ttl-1')
  t.equal(again.headers['idempotent-replayed'], 'true', 'the new execution is recorded in turn')
  t.equal(again.body, fresh.body)
})

t.test('well after the ttl the key still executes as new (and the expired record is gone)', async (t) => {
  const { clock, store, app, count, handler } = await setup(t)
  app.post('/pay', handler('/pay'))
  await post(app, '/pay', 'ttl-2')
  clock.advance(TTL * 10)
  t.equal(await store.get({ scope: 'test', key: 'ttl-2' }), null, 'an expired record is never read back')
  const res = await post(app, '/pay', 'ttl-2')
  t.equal(res.headers['idempotent-replayed'], undefined)
  t.equal(count('/pay'), 2)
})

t.test('the ttl counts from completion: a handler that completes later is retained longer', async (t) => {
  // The lease is as long as the ttl so the held owner keeps its key whatever the clock says.
  const { clock, app } = await setup(t, { lease: TTL })
  const gate = deferred()
  const started = deferred()
  let executions = 0
  app.post('/pay', async (_request, reply) => {
    executions++
    started.resolve()
    await gate.promise
    reply.code(201)
    return { done: true }
  })

  const original = post(app, '/pay', 'late')
  await started.promise
  clock.advance(50_000) // the handler runs for 50 s of clock time
  gate.resolve()
  const first = await original
  t.equal(first.statusCode, 201)

  clock.advance(TTL - 1) // 110 s after the claim, ttl − 1 ms after completion
  const replay = await post(app, '/pay', 'late')
  t.equal(executions, 1)
  t.equal(replay.headers['idempotent-replayed'], 'true', 'still replayed ttl − 1 ms after completion (past ttl after the claim)')
  t.equal(replay.body, first.body)

  clock.advance(1)
  const fresh = await post(app, '/pay', 'late')
  t.equal(fresh.headers['idempotent-replayed'], undefined, 'executes as new exactly ttl after completion')
  t.equal(executions, 2)
})

t.test('a per-route ttl overrides the global one', async (t) => {
  const { clock, app, count, handler } = await setup(t)
  app.post('/short', { config: { idempotency: { ttl: 1_000, lease: 1_000 } } }, handler('/short'))
  app.post('/long', handler('/long'))

  await post(app, '/short', 'route-ttl')
  await post(app, '/long', 'route-ttl-long')

  clock.advance(999)
  t.equal((await post(app, '/short', 'route-ttl')).headers['idempotent-replayed'], 'true', 'the short route replays before its own ttl')

  clock.advance(1)
  const short = await post(app, '/short', 'route-ttl')
  t.equal(short.headers['idempotent-replayed'], undefined, 'the short route executes as new at its own ttl (1 s)')
  t.equal(count('/short'), 2)

  const long = await post(app, '/long', 'route-ttl-long')
  t.equal(long.headers['idempotent-replayed'], 'true', 'the other route still uses the global ttl (60 s)')
  t.equal(count('/long'), 1)
})

t.test('purgeExpired removes expired records in bounded batches while claims go on', async (t) => {
  const { clock, store, app, count, handler } = await setup(t)
  app.post('/pay', handler('/pay'))

  const OLD = 200
  const statuses = new Set<number>()
  for (let i = 0; i < OLD; i++) statuses.add((await post(app, '/pay', `old-${i}`)).statusCode)
  t.same([...statuses], [201], `${OLD} records created`)
  t.equal(count('/pay'), OLD)
  t.equal(await store.purgeExpired(10), 0, 'nothing is purged before the ttl')

  clock.advance(TTL)
  const purged: number[] = []
  const ROUNDS = 30
  for (let i = 0; i < ROUNDS; i++) {
    // A purge batch, a brand new key and a retry of an expired key, all at once.
    const [batch, fresh, reused] = await Promise.all([
      store.purgeExpired(10),
      post(app, '/pay', `new-${i}`),
      post(app, '/pay', `old-${i}`)
    ])
    purged.push(batch)
    t.equal(fresh.statusCode, 201)
    t.equal(fresh.headers['idempotent-replayed'], undefined, `new-${i} executed`)
    t.equal(reused.headers['idempotent-replayed'], undefined, `old-${i} is expired: it executes as new`)
  }
  t.ok(purged.every((n) => n <= 10), 'every batch is bounded by its limit')
  t.equal(count('/pay'), OLD + 2 * ROUNDS, 'every claim during the purge executed')

  let rest = 0
  for (let n = await store.purgeExpired(10); n > 0; n = await store.purgeExpired(10)) rest += n
  const total = purged.reduce((a, b) => a + b, 0) + rest
  // Each expired record went exactly once: by a purge batch, or dropped by the claim that reused
  // its key (a claim never waits for a purge, and a purge never takes a live record).
  t.ok(total >= OLD - ROUNDS && total <= OLD, `the purges removed the expired records (${total} of ${OLD})`)

  for (let i = 0; i < ROUNDS; i++) {
    t.equal((await store.get({ scope: 'test', key: `new-${i}` }))?.state, 'completed', `new-${i} kept`)
    t.equal((await store.get({ scope: 'test', key: `old-${i}` }))?.state, 'completed', `old-${i} (re-executed) kept`)
  }
  for (let i = ROUNDS; i < OLD; i++) {
    if (await store.get({ scope: 'test', key: `old-${i}` }) !== null) t.fail(`old-${i} should be gone`)
  }
  t.equal(await store.purgeExpired(), 0, 'nothing expired is left')

  // The live records survive the purge: they replay.
  const replay = await post(app, '/pay', 'new-0')
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal(count('/pay'), OLD + 2 * ROUNDS)
})
