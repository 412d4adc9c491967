import Fastify, { type FastifyInstance } from 'fastify'
import t from 'tap'
import idempotency, { memoryStore, type IdempotencyStore, type ProfileName } from '../../lib/index.js'
import { keyed } from '../helpers/app.js'

/*
 * The plugin calls the methods of the store object it was given, and nothing else: a wrapper
 * (logging, metrics, a circuit breaker, fault injection) sees every call, whether it was built with
 * a Proxy, by spreading the store, or on top of it as a prototype. A memory store used to carry
 * hidden synchronous twins of claim/complete/release that the plugin called instead, so a wrapper
 * that failed "while the store is down" was routed around: the handler ran unprotected and
 * answered 201. Every way of wrapping, under every error profile, must get the store's 503 instead.
 */

type Method = 'claim' | 'complete' | 'release' | 'renew'
const WRAPPED: readonly Method[] = ['claim', 'complete', 'release', 'renew']

interface Switchboard {
  down: boolean
  readonly calls: Record<Method, number>
}

/** What each wrapper does around a call: count it, and fail it while the store is "down". */
function around (board: Switchboard, method: Method, call: () => unknown): unknown {
  board.calls[method]++
  if (board.down) return Promise.reject(new Error(`${method}: the store is down`))
  return call()
}

const wrappers: Record<string, (store: IdempotencyStore, board: Switchboard) => IdempotencyStore> = {
  proxy: (store, board) => new Proxy(store, {
    get (target, property, receiver) {
      const value: unknown = Reflect.get(target, property, receiver)
      if (typeof value !== 'function') return value
      const method = value as (...args: unknown[]) => unknown
      return (...args: unknown[]) => (WRAPPED as readonly PropertyKey[]).includes(property)
        ? around(board, property as Method, () => method.apply(target, args))
        : method.apply(target, args)
    }
  }),
  spread: (store, board) => ({
    ...store,
    claim: (request) => around(board, 'claim', () => store.claim(request)) as ReturnType<IdempotencyStore['claim']>,
    complete: (lease, response, ttl) => around(board, 'complete', () => store.complete(lease, response, ttl)) as ReturnType<IdempotencyStore['complete']>,
    release: (lease) => around(board, 'release', () => store.release(lease)) as ReturnType<IdempotencyStore['release']>,
    renew: (lease, ms) => around(board, 'renew', () => store.renew(lease, ms)) as ReturnType<IdempotencyStore['renew']>
  }),
  prototype: (store, board) => Object.assign(Object.create(store) as IdempotencyStore, {
    claim: (request: Parameters<IdempotencyStore['claim']>[0]) => around(board, 'claim', () => store.claim(request)),
    complete: (...args: Parameters<IdempotencyStore['complete']>) => around(board, 'complete', () => store.complete(...args)),
    release: (lease: Parameters<IdempotencyStore['release']>[0]) => around(board, 'release', () => store.release(lease)),
    renew: (...args: Parameters<IdempotencyStore['renew']>) => around(board, 'renew', () => store.renew(...args))
  })
}

const PROFILES: readonly ProfileName[] = ['ietf', 'stripe']

async function appOn (store: IdempotencyStore, profile: ProfileName, encrypted: boolean): Promise<{ app: FastifyInstance, runs: () => number }> {
  const app = Fastify()
  await app.register(idempotency, {
    store,
    profile,
    scope: () => 'tenant',
    ...(encrypted ? { encryption: { keys: [{ id: 'k1', key: Buffer.alloc(32, 7) }] } } : {})
  })
  let runs = 0
  app.post('/charges', async (_request, reply) => reply.code(201).send({ id: `ch_${++runs}` }))
  return { app, runs: () => runs }
}

for (const [style, wrap] of Object.entries(wrappers)) {
  for (const profile of PROFILES) {
    for (const encrypted of [false, true]) {
      t.test(`a store wrapped (${style}), profile ${profile}${encrypted ? ', encrypted' : ''}: the wrapper sees every call; while it fails, 503 and the handler never runs`, async (t) => {
        const inner = memoryStore({ purgeInterval: 0 })
        const board: Switchboard = { down: true, calls: { claim: 0, complete: 0, release: 0, renew: 0 } }
        const { app, runs } = await appOn(wrap(inner, board), profile, encrypted)
        t.teardown(async () => { await app.close(); await inner.close() })

        const refused = await app.inject({ method: 'POST', url: '/charges', headers: keyed('down-1'), payload: { amount: 1 } })
        t.equal(refused.statusCode, 503, 'the wrapper\'s failure is the store\'s failure')
        t.equal(runs(), 0, 'the handler did not run unprotected')
        t.equal(board.calls.claim, 1, 'the claim went through the wrapper')
        t.equal(await inner.get({ scope: 'tenant', key: 'down-1' }), null, 'and never reached the store behind it')

        board.down = false
        const first = await app.inject({ method: 'POST', url: '/charges', headers: keyed('up-1'), payload: { amount: 1 } })
        t.equal(first.statusCode, 201)
        const again = await app.inject({ method: 'POST', url: '/charges', headers: keyed('up-1'), payload: { amount: 1 } })
        t.equal(again.headers['idempotent-replayed'], 'true')
        t.equal(again.body, first.body)
        t.equal(runs(), 1)
        t.equal(board.calls.claim, 3, 'every claim went through the wrapper')
        t.equal(board.calls.complete, 1, 'and the record too')
      })
    }
  }
}

t.test('a store whose operations answer directly or through promises, or throw: the same outcomes', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  let mode: 'direct' | 'promise' | 'throw' = 'direct'
  const store: IdempotencyStore = {
    ...inner,
    claim: (request) => {
      if (mode === 'throw') throw new Error('claim: thrown')
      const result = inner.claim(request)
      return mode === 'promise' ? Promise.resolve(result) : result
    }
  }
  const { app, runs } = await appOn(store, 'ietf', false)
  t.teardown(() => app.close())
  for (const each of ['direct', 'promise'] as const) {
    mode = each
    const first = await app.inject({ method: 'POST', url: '/charges', headers: keyed(`k-${each}`), payload: {} })
    const again = await app.inject({ method: 'POST', url: '/charges', headers: keyed(`k-${each}`), payload: {} })
    t.equal(first.statusCode, 201, `${each}: executed`)
    t.equal(again.headers['idempotent-replayed'], 'true', `${each}: replayed`)
  }
  mode = 'throw'
  const thrown = await app.inject({ method: 'POST', url: '/charges', headers: keyed('k-throw'), payload: {} })
  t.equal(thrown.statusCode, 503, 'a claim that throws is a store failure')
  t.equal(runs(), 2)
})
