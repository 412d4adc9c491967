import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import type { IdempotencyPrefilter } from '../../lib/core/prefilter.js'
import type { Answer } from '../../lib/core/store.js'
import { keyed } from '../helpers/app.js'
import { sleep } from '../helpers/sleep.js'

/*
 * Timings the simulation of the request lifecycle (test/simulation/) found, each pinned here with
 * real timers: the margin a claim needs before its lease lapses, a renewal that hangs, a pre-filter
 * that never answers, and a handler that changes the status of an answer being settled.
 */

const LEASE = 300

/** The memory store with some operations delayed (or never answered), as a slow network would. */
function delayed (inner: IdempotencyStore, delays: { claim?: () => number | null, renew?: () => number | null, release?: () => number | null }): IdempotencyStore {
  const after = <T>(ms: number | null | undefined, call: () => Answer<T>): Answer<T> => {
    if (ms === undefined) return call()
    // Applied at once, answered later (or never): the store did the work, the answer is slow.
    const result = call()
    return ms === null ? new Promise<T>(() => {}) : sleep(ms).then(async () => await result)
  }
  return {
    ...inner,
    claim: (request) => after(delays.claim?.(), () => inner.claim(request)),
    renew: (lease, ms) => after(delays.renew?.(), () => inner.renew(lease, ms)),
    release: (lease) => after(delays.release?.(), () => inner.release(lease))
  }
}

async function app (t: Test, store: IdempotencyStore, options: IdempotencyOptions = {}, fastify = {}): Promise<{ app: FastifyInstance, runs: () => number }> {
  const instance = Fastify(fastify)
  t.teardown(() => instance.close())
  await instance.register(idempotency, { store, scope: () => 't', lease: LEASE, storeTimeout: 2000, ...options })
  let runs = 0
  instance.post('/pay', async (_request, reply) => {
    runs++
    await sleep(200)
    return reply.code(201).send({ run: runs })
  })
  return { app: instance, runs: () => runs }
}

t.test('a claim answered with less than a renewal interval of its lease left is given back (503), so it never runs beside a takeover', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  let slow = true
  const first = await app(t, delayed(inner, { claim: () => slow ? LEASE - 50 : undefined as unknown as null }))
  const answer = await first.app.inject({ method: 'POST', url: '/pay', headers: keyed('late-in-lease'), payload: {} })
  t.equal(answer.statusCode, 503, 'answered as a store failure')
  t.equal(first.runs(), 0, 'the handler did not run on a lease about to lapse')
  t.equal(await inner.get({ scope: 't', key: 'late-in-lease' }), null, 'and the claim was given back')
  slow = false
})

t.test('a claim answered with less than two renewal intervals left renews at once: one failed renewal after it still keeps the key', async (t) => {
  // A longer lease than the file's, so that a loaded machine's stalled event loop does not decide
  // the outcome: the renewal after the failed one has a sixth of the lease (400 ms) to land.
  const lease = 2400
  const interval = lease / 3
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  let renewals = 0
  // Answered with 1.5 renewal intervals of its lease left; its first renewal fails. Renewed only on
  // the schedule, the next try would come after the lease lapsed.
  const first = await app(t, {
    ...delayed(inner, { claim: () => lease - interval * 1.5 }),
    renew: async (owned, ms) => {
      if (++renewals === 1) throw new Error('renewal lost on the way')
      return await inner.renew(owned, ms)
    }
  }, { lease })
  const second = await app(t, inner, { lease })
  let runs = 0
  for (const { app } of [first, second]) {
    // Still running when the first lease lapses.
    app.post('/long', async (_request, reply) => { runs++; await sleep(lease); return reply.code(201).send({ long: true }) })
  }
  const original = first.app.inject({ method: 'POST', url: '/long', headers: keyed('renew-now'), payload: {} })
  await sleep(lease + 100) // past the lease the claim was granted: only a renewal keeps the key
  const retry = await second.app.inject({ method: 'POST', url: '/long', headers: keyed('renew-now'), payload: {} })
  t.equal(retry.statusCode, 409, 'the owner renewed in time: no takeover')
  t.ok(renewals >= 2, `the failed renewal was tried again (${renewals})`)
  t.equal((await original).statusCode, 201)
  t.equal(runs, 1, 'one execution')
})

t.test('a renewal that hangs does not hold back the next one, even with a storeTimeout longer than the lease', async (t) => {
  const lease = 900 // long enough that a stalled event loop does not lapse it between renewals
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  let renewals = 0
  // The first renewal is applied and never answered; the next ones answer at once.
  const first = await app(t, delayed(inner, { renew: () => ++renewals === 1 ? null : undefined as unknown as null }), { lease, storeTimeout: 2000 })
  first.app.post('/long', async (_request, reply) => { await sleep(lease * 3); return reply.code(201).send({ long: true }) })
  const second = await app(t, inner, { lease })
  second.app.post('/long', async (_request, reply) => reply.code(201).send({ long: 'retry' }))
  const original = first.app.inject({ method: 'POST', url: '/long', headers: keyed('hung-renewal'), payload: {} })
  await sleep(lease * 2)
  const retry = await second.app.inject({ method: 'POST', url: '/long', headers: keyed('hung-renewal'), payload: {} })
  t.equal(retry.statusCode, 409, 'two leases in, the owner still holds its key')
  t.ok(renewals >= 3, `renewals went on past the hung one (${renewals})`)
  t.equal((await original).statusCode, 201)
})

t.test('a pre-filter that never answers does not hold the request: after storeTimeout the store answers', async (t) => {
  const silent = (): Promise<never> => new Promise(() => {})
  const prefilter: IdempotencyPrefilter = {
    lookup: silent,
    lookupOrMark: silent,
    markInFlight: silent,
    clearInFlight: silent,
    remember: silent,
    close: async () => {}
  }
  for (const wait of [0, 500]) {
    const store = memoryStore({ purgeInterval: 0 })
    t.teardown(() => store.close())
    const { app: instance, runs } = await app(t, store, { prefilter, storeTimeout: 100, wait })
    const started = Date.now()
    const answer = await instance.inject({ method: 'POST', url: '/pay', headers: keyed(`silent-${wait}`), payload: {} })
    t.equal(answer.statusCode, 201, `wait ${wait}: answered`)
    t.ok(Date.now() - started < 2000, `wait ${wait}: within its bounds (${Date.now() - started} ms)`)
    t.equal(runs(), 1)
  }
})

t.test('atomic mode: a handler interrupted by handlerTimeout that calls reply.code() on its way out does not change the status of the answer being settled', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  // Atomic mode as the plugin sees it (a claim with a transaction handle); its rollback takes a
  // while, and the handler returns meanwhile.
  const store: IdempotencyStore = {
    ...delayed(inner, { release: () => 150 }),
    claimInTransaction: async (request) => {
      const result = inner.claim(request)
      return result.outcome === 'acquired' ? { ...result, transaction: {} } : result
    }
  }
  const instance = Fastify({ handlerTimeout: 50 })
  t.teardown(() => instance.close())
  await instance.register(idempotency, { store, scope: () => 't', lease: LEASE, storeTimeout: 2000, transaction: true })
  instance.post('/pay', async (_request, reply) => {
    await sleep(100)
    return reply.code(201).send({ charged: true })
  })
  const answer = await instance.inject({ method: 'POST', url: '/pay', headers: keyed('late-code'), payload: {} })
  t.equal(answer.statusCode, 503, 'the timeout\'s status, not the late 201')
  t.equal(answer.json().code, 'FST_ERR_HANDLER_TIMEOUT', 'with its body')
})
