import Fastify from 'fastify'
import t from 'tap'
import idempotency, { memoryStore, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import { PROBLEM_TYPE } from '../helpers/app.js'
import { sleep } from '../helpers/sleep.js'

/*
 * A lease-mode claim that the store answers only after one lease (chaos harness, node-postgres full
 * run: a 728 ms claim under a 300 ms lease started its handler while another instance, which had
 * taken the lapsed key over, ran the same operation). The answer proves nothing about now, so the
 * handler must not run: the key is given back and the client gets the store's 503.
 */

const LEASE = 100
const keyed = (key: string): Record<string, string> => ({ 'idempotency-key': `"${key}"`, 'content-type': 'application/json' })

/** The memory store, with the claims of keys starting `slow-` answered `delayMs` after they were applied. */
function slowClaims (delayMs: number, store: IdempotencyStore = memoryStore({ purgeInterval: 0 })): IdempotencyStore & { readonly inner: IdempotencyStore } {
  return new Proxy(store, {
    get (target, property, receiver) {
      if (property === 'inner') return target
      if (property === 'claim') {
        return async (...args: Parameters<IdempotencyStore['claim']>) => {
          const result = await target.claim(...args)
          if (args[0].key.startsWith('slow-')) await sleep(delayMs)
          return result
        }
      }
      const value: unknown = Reflect.get(target, property, receiver)
      return typeof value === 'function' ? (value as (...a: unknown[]) => unknown).bind(target) : value
    }
  }) as IdempotencyStore & { readonly inner: IdempotencyStore }
}

async function appOn (store: IdempotencyStore): Promise<{ app: ReturnType<typeof Fastify>, runs: () => number }> {
  const app = Fastify()
  // `wait` makes the claim go through the store's promise, as every store but the memory store's
  // synchronous path does (a Postgres or Redis-fronted claim).
  await app.register(idempotency, { store, scope: () => 't', lease: LEASE, storeTimeout: 2000, wait: 1 })
  let runs = 0
  app.post('/pay', async (_request, reply) => { runs++; return reply.code(201).send({ run: runs }) })
  return { app, runs: () => runs }
}

t.test('a claim answered after its lease: the handler does not run, the key is given back, 503', async (t) => {
  const store = slowClaims(LEASE + 50)
  const { app, runs } = await appOn(store)
  t.teardown(() => app.close())
  const late = await app.inject({ method: 'POST', url: '/pay', headers: keyed('slow-1'), payload: {} })
  t.equal(late.statusCode, 503, 'the store failure answer')
  t.equal(late.json().type, PROBLEM_TYPE('store-unavailable'))
  t.ok(late.headers['retry-after'] !== undefined, 'with Retry-After')
  t.equal(runs(), 0, 'the handler did not run on an unproven lease')
  t.equal(await store.get({ scope: 't', key: 'slow-1' }), null, 'the claim was released: the key is not stuck for a lease')
})

t.test('a claim answered within its lease runs as usual', async (t) => {
  const store = slowClaims(LEASE / 4)
  const { app, runs } = await appOn(store)
  t.teardown(() => app.close())
  const first = await app.inject({ method: 'POST', url: '/pay', headers: keyed('slow-2'), payload: {} })
  t.equal(first.statusCode, 201)
  const again = await app.inject({ method: 'POST', url: '/pay', headers: keyed('slow-2'), payload: {} })
  t.equal(again.headers['idempotent-replayed'], 'true')
  t.equal(runs(), 1)
})

t.test('the late claim taken over meanwhile: the new owner runs once, the late one not at all', async (t) => {
  const store = slowClaims(LEASE * 3)
  const { app, runs } = await appOn(store)
  t.teardown(() => app.close())
  // The first attempt's claim is applied at once and answered three leases later; meanwhile its
  // lease lapses and the retry (the same request) takes the key over through a store that answers at once.
  const late = app.inject({ method: 'POST', url: '/pay', headers: keyed('slow-3'), payload: {} })
  await sleep(LEASE * 1.5)
  const fast = Fastify()
  t.teardown(() => fast.close())
  await fast.register(idempotency, { store: slowClaims(0, store.inner), scope: () => 't', lease: LEASE, storeTimeout: 2000, wait: 1 })
  let fastRuns = 0
  fast.post('/pay', async (_request, reply) => { fastRuns++; return reply.code(201).send({ run: 'retry' }) })
  const retry = await fast.inject({ method: 'POST', url: '/pay', headers: keyed('slow-3'), payload: {} })
  t.equal(retry.statusCode, 201, 'the retry took the lapsed key over and ran')
  t.equal((await late).statusCode, 503, 'the late attempt answers 503')
  t.equal(runs(), 0, 'and never ran: one execution for the key')
  t.equal(fastRuns, 1)
  const record = await store.get({ scope: 't', key: 'slow-3' })
  t.equal(record?.state, 'completed', "the retry's outcome stands (the late release was fenced out)")
})

t.test('a late takeover is not released: the recorded steps of the operation it took over stay', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  let slow = false
  // The first owner's renewals answer true without extending its lease: it runs on while its lease
  // lapses, as an owner cut from the store would.
  const store = new Proxy(inner, {
    get (target, property) {
      if (property === 'renew') return async () => true
      if (property === 'claim') {
        return async (...args: Parameters<IdempotencyStore['claim']>) => {
          const result = await target.claim(...args)
          if (slow) await sleep(LEASE * 2)
          return result
        }
      }
      const value: unknown = Reflect.get(target, property)
      return typeof value === 'function' ? (value as (...a: unknown[]) => unknown).bind(target) : value
    }
  })
  const app = Fastify()
  const hang = deferredGate()
  t.teardown(async () => { hang.open(); await app.close() })
  await app.register(idempotency, { store, scope: () => 't', lease: LEASE, storeTimeout: 2000, wait: 1 })
  let runs = 0
  app.post('/steps', async (request, reply) => {
    runs++
    await request.idempotency!.step('reserve', () => 'reserved')
    await hang.wait
    return reply.code(201).send({ run: runs })
  })
  const original = app.inject({ method: 'POST', url: '/steps', headers: keyed('steps-1'), payload: {} })
  for (let i = 0; i < 100 && (await inner.inspect?.({ scope: 't', key: 'steps-1' }))?.steps.reserve === undefined; i++) await sleep(10)
  await sleep(LEASE * 1.5) // the lease has lapsed
  slow = true
  const retry = await app.inject({ method: 'POST', url: '/steps', headers: keyed('steps-1'), payload: {} })
  t.equal(retry.statusCode, 503, 'the takeover was answered after its lease: 503')
  t.equal(runs, 1, 'the retry ran nothing')
  const record = await inner.inspect?.({ scope: 't', key: 'steps-1' })
  t.equal(record?.state, 'in_progress', 'the record is still there')
  t.same(record?.steps, { reserve: 'reserved' }, 'with the step the first owner recorded: a later takeover continues from it')
  hang.open()
  await original
})

function deferredGate (): { wait: Promise<void>, open: () => void } {
  let open!: () => void
  const wait = new Promise<void>((resolve) => { open = resolve })
  return { wait, open }
}

t.test('atomic mode: a takeover that lands after storeTimeout is still rolled back (its transaction holds a connection and a lock)', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  const released: string[] = []
  // A store with atomic mode whose claims land after storeTimeout, as takeovers with an open transaction.
  const store: IdempotencyStore = Object.assign(Object.create(inner) as IdempotencyStore, {
    claim: inner.claim.bind(inner),
    release: async (lease: { token: string }) => { released.push(lease.token); return true },
    claimInTransaction: async (request: Parameters<IdempotencyStore['claim']>[0]) => {
      await sleep(150)
      return { outcome: 'acquired' as const, lease: { scope: request.scope, key: request.key, token: 'tx-token' }, takeover: true, transaction: {} }
    }
  })
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: () => 't', storeTimeout: 50, transaction: true })
  let runs = 0
  app.post('/pay', async (_request, reply) => { runs++; return reply.code(201).send({}) })
  const res = await app.inject({ method: 'POST', url: '/pay', headers: keyed('atomic-late'), payload: {} })
  t.equal(res.statusCode, 503)
  t.equal(runs, 0)
  for (let i = 0; i < 50 && released.length === 0; i++) await sleep(10)
  t.same(released, ['tx-token'], 'the late takeover was released: its transaction rolls back')
})

/*
 * An answer that goes out while the claim is still in flight: Fastify's handlerTimeout (it runs from
 * routing, so it covers the preHandler hooks), with any slow step before the claim lands (a slow
 * store, an async scope or fingerprint, a wait). The claim that lands afterwards must be given back
 * at once and the handler must never run: otherwise the key stays in progress under a renewal that
 * nothing ever stops, and every retry is answered 409 forever.
 */
t.test('a handlerTimeout that answers before the claim lands: the handler never runs, the key is given back at once, and the retry runs once', async (t) => {
  const slowSteps: Record<string, IdempotencyOptions> = {
    'slow store': {},
    'async scope': { scope: async () => { await sleep(120); return 't' } },
    'async fingerprint': { fingerprint: async () => { await sleep(120); return 'same' } }
  }
  for (const [step, options] of Object.entries(slowSteps)) {
    const inner = memoryStore({ purgeInterval: 0 })
    let slowClaims = step === 'slow store'
    const store = new Proxy(inner, {
      get (target, property) {
        if (property === 'claim') {
          return async (...args: Parameters<IdempotencyStore['claim']>) => {
            if (slowClaims) await sleep(120)
            return target.claim(...args)
          }
        }
        const value: unknown = Reflect.get(target, property)
        return typeof value === 'function' ? (value as (...a: unknown[]) => unknown).bind(target) : value
      }
    })
    const app = Fastify({ handlerTimeout: 50 })
    t.teardown(async () => { await app.close(); await inner.close() })
    await app.register(idempotency, { store, scope: () => 't', lease: LEASE, storeTimeout: 2000, ...options })
    let runs = 0
    app.post('/pay', async (_request, reply) => { runs++; return reply.code(201).send({ run: runs }) })

    const timedOut = await app.inject({ method: 'POST', url: '/pay', headers: keyed(`timeout-${step}`), payload: {} })
    t.equal(timedOut.statusCode, 503, `${step}: Fastify's handlerTimeout answered`)
    await sleep(200) // the claim has landed
    t.equal(runs, 0, `${step}: the handler never ran`)
    t.equal(await inner.get({ scope: 't', key: `timeout-${step}` }), null, `${step}: the key was given back, not left in progress`)
    slowClaims = false
    const fast = Fastify()
    t.teardown(() => fast.close())
    await fast.register(idempotency, { store, scope: () => 't', lease: LEASE, ...options })
    fast.post('/pay', async (_request, reply) => { runs++; return reply.code(201).send({ run: runs }) })
    const retry = await fast.inject({ method: 'POST', url: '/pay', headers: keyed(`timeout-${step}`), payload: {} })
    t.equal(retry.statusCode, 201, `${step}: the retry is not refused 409`)
    t.equal(runs, 1, `${step}: and runs once`)
  }
})

t.test('the claim lands while the timeout\'s answer is still on its way out: the handler does not run beside it', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  const store = new Proxy(inner, {
    get (target, property) {
      if (property === 'claim') {
        return async (...args: Parameters<IdempotencyStore['claim']>) => {
          await sleep(80)
          return target.claim(...args)
        }
      }
      const value: unknown = Reflect.get(target, property)
      return typeof value === 'function' ? (value as (...a: unknown[]) => unknown).bind(target) : value
    }
  })
  const app = Fastify({ handlerTimeout: 50 })
  t.teardown(async () => { await app.close(); await inner.close() })
  await app.register(idempotency, { store, scope: () => 't', lease: LEASE, storeTimeout: 2000 })
  // An onSend hook that takes its time over the timeout's 503 (compression, a logger that awaits).
  app.addHook('onSend', async (_request, reply, payload) => {
    if (reply.statusCode === 503) await sleep(100)
    return payload
  })
  let runs = 0
  app.post('/pay', async (_request, reply) => { runs++; return reply.code(201).send({ run: runs }) })
  const timedOut = await app.inject({ method: 'POST', url: '/pay', headers: keyed('in-flight-503'), payload: {} })
  t.equal(timedOut.statusCode, 503)
  await sleep(150)
  t.equal(runs, 0, 'the handler never ran')
  t.equal(await inner.get({ scope: 't', key: 'in-flight-503' }), null, 'the key was given back')
})
