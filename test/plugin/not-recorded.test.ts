import type { FastifyInstance, FastifyServerOptions, InjectOptions, LightMyRequestResponse, RouteShorthandOptions } from 'fastify'
import t, { type Test } from 'tap'
import { memoryStore, type IdempotencyOptions } from '../../lib/index.js'
import { buildApp, keyed } from '../helpers/app.js'

/*
 * Behaviour 8 of the contract: a request rejected before the handler (schema validation, auth,
 * body parsing, rate limiting, body size) never claims its key, so nothing is recorded and a
 * corrected retry with the same key executes. Every test follows the same three steps:
 * the rejected attempt leaves no record; the corrected retry runs the handler once (201);
 * a further retry replays that 201.
 */

const SCOPE = 'test'

async function setup (t: Test, plugin: IdempotencyOptions = {}, fastify?: FastifyServerOptions) {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store, ...plugin }, fastify })
  return { app, store }
}

/** POST /pay answering 201 with a fresh charge id per run. */
function payRoute (app: FastifyInstance, options: RouteShorthandOptions = {}): { runs: () => number } {
  let runs = 0
  app.post('/pay', options, async (_request, reply) => {
    runs++
    return reply.code(201).send({ id: `ch_${runs}` })
  })
  return { runs: () => runs }
}

/**
 * The shared second half of every test: the corrected request executes once, then replays.
 */
async function correctedRetryExecutesOnce (
  t: Test,
  app: FastifyInstance,
  store: ReturnType<typeof memoryStore>,
  key: string,
  corrected: InjectOptions,
  runs: () => number
): Promise<void> {
  t.equal(runs(), 0, 'the handler did not run for the rejected attempt')
  t.equal(await store.get({ scope: SCOPE, key }), null, 'the rejected attempt left no record')

  const retry: LightMyRequestResponse = await app.inject(corrected)
  t.equal(retry.statusCode, 201, 'the corrected retry executes')
  t.equal(retry.headers['idempotent-replayed'], undefined, 'it is not a replay of the rejection')
  t.same(retry.json(), { id: 'ch_1' })
  t.equal(runs(), 1)
  t.equal((await store.get({ scope: SCOPE, key }))?.state, 'completed', 'the executed request is recorded')

  const again = await app.inject(corrected)
  t.equal(again.statusCode, 201)
  t.equal(again.headers['idempotent-replayed'], 'true', 'a further retry replays it')
  t.ok(again.rawPayload.equals(retry.rawPayload))
  t.equal(runs(), 1, 'the handler still ran once')
}

t.test('a schema validation 400 is not recorded: the corrected retry with the same key executes', async (t) => {
  const { app, store } = await setup(t)
  const route = payRoute(app, {
    schema: {
      body: {
        type: 'object',
        required: ['amount'],
        properties: { amount: { type: 'number' } }
      }
    }
  })

  const rejected = await app.inject({ method: 'POST', url: '/pay', headers: keyed('schema-1'), payload: { currency: 'eur' } })
  t.equal(rejected.statusCode, 400)
  t.match(rejected.json(), { code: 'FST_ERR_VALIDATION' }, "Fastify's own validation error, not a plugin problem")
  t.equal(rejected.headers['idempotent-replayed'], undefined)

  // A second identical invalid attempt is validated again (not a replayed 400, not a 409).
  const again = await app.inject({ method: 'POST', url: '/pay', headers: keyed('schema-1'), payload: { currency: 'eur' } })
  t.equal(again.statusCode, 400)
  t.equal(again.headers['idempotent-replayed'], undefined)

  await correctedRetryExecutesOnce(t, app, store, 'schema-1',
    { method: 'POST', url: '/pay', headers: keyed('schema-1'), payload: { currency: 'eur', amount: 100 } }, route.runs)
})

t.test('an auth onRequest hook answering 401 is not recorded: the authenticated retry executes', async (t) => {
  const { app, store } = await setup(t)
  app.addHook('onRequest', async (request, reply) => {
    if (request.headers.authorization === undefined) return reply.code(401).send({ error: 'unauthorized' })
  })
  const route = payRoute(app)

  const rejected = await app.inject({ method: 'POST', url: '/pay', headers: keyed('auth-1'), payload: { amount: 100 } })
  t.equal(rejected.statusCode, 401)
  t.same(rejected.json(), { error: 'unauthorized' })

  await correctedRetryExecutesOnce(t, app, store, 'auth-1',
    { method: 'POST', url: '/pay', headers: keyed('auth-1', { authorization: 'Bearer t' }), payload: { amount: 100 } }, route.runs)
})

t.test('an auth preHandler hook answering 401 is not recorded: the authenticated retry executes', async (t) => {
  // An instance preHandler runs before the plugin's route-level preHandler (the claim).
  const { app, store } = await setup(t)
  app.addHook('preHandler', async (request, reply) => {
    if (request.headers.authorization === undefined) return reply.code(401).send({ error: 'unauthorized' })
  })
  const route = payRoute(app)

  const rejected = await app.inject({ method: 'POST', url: '/pay', headers: keyed('auth-2'), payload: { amount: 100 } })
  t.equal(rejected.statusCode, 401)

  await correctedRetryExecutesOnce(t, app, store, 'auth-2',
    { method: 'POST', url: '/pay', headers: keyed('auth-2', { authorization: 'Bearer t' }), payload: { amount: 100 } }, route.runs)
})

t.test('an auth hook that throws a 401 error is not recorded either', async (t) => {
  const { app, store } = await setup(t)
  app.addHook('preHandler', async (request) => {
    if (request.headers.authorization === undefined) {
      throw Object.assign(new Error('missing credentials'), { statusCode: 401 })
    }
  })
  const route = payRoute(app)

  const rejected = await app.inject({ method: 'POST', url: '/pay', headers: keyed('auth-3'), payload: { amount: 100 } })
  t.equal(rejected.statusCode, 401)

  await correctedRetryExecutesOnce(t, app, store, 'auth-3',
    { method: 'POST', url: '/pay', headers: keyed('auth-3', { authorization: 'Bearer t' }), payload: { amount: 100 } }, route.runs)
})

t.test('a malformed JSON body (parse error 400) is not recorded: the corrected retry executes', async (t) => {
  const { app, store } = await setup(t)
  const route = payRoute(app)

  const rejected = await app.inject({ method: 'POST', url: '/pay', headers: keyed('parse-1'), payload: '{"amount": 100' })
  t.equal(rejected.statusCode, 400)
  t.match(rejected.json(), { code: 'FST_ERR_CTP_INVALID_JSON_BODY' })

  await correctedRetryExecutesOnce(t, app, store, 'parse-1',
    { method: 'POST', url: '/pay', headers: keyed('parse-1'), payload: '{"amount": 100}' }, route.runs)
})

t.test('a malformed JSON body in raw fingerprint mode (hashed while streaming) is not recorded either', async (t) => {
  const { app, store } = await setup(t, { fingerprint: 'raw' })
  const route = payRoute(app)

  const rejected = await app.inject({ method: 'POST', url: '/pay', headers: keyed('parse-2'), payload: '{"amount": 100' })
  t.equal(rejected.statusCode, 400)

  await correctedRetryExecutesOnce(t, app, store, 'parse-2',
    { method: 'POST', url: '/pay', headers: keyed('parse-2'), payload: '{"amount": 100}' }, route.runs)
})

t.test('an unsupported content type (415) is not recorded: the corrected retry executes', async (t) => {
  const { app, store } = await setup(t)
  const route = payRoute(app)

  const rejected = await app.inject({
    method: 'POST', url: '/pay', headers: keyed('ctype-1', { 'content-type': 'application/x-unknown' }), payload: 'amount=100'
  })
  t.equal(rejected.statusCode, 415)

  await correctedRetryExecutesOnce(t, app, store, 'ctype-1',
    { method: 'POST', url: '/pay', headers: keyed('ctype-1'), payload: { amount: 100 } }, route.runs)
})

t.test('a rate-limit onRequest hook answering 429 is not recorded: the later retry executes', async (t) => {
  const { app, store } = await setup(t)
  let limited = true
  app.addHook('onRequest', async (_request, reply) => {
    if (limited) return reply.code(429).header('retry-after', '1').send({ error: 'too_many_requests' })
  })
  const route = payRoute(app)

  const rejected = await app.inject({ method: 'POST', url: '/pay', headers: keyed('rate-1'), payload: { amount: 100 } })
  t.equal(rejected.statusCode, 429)
  t.equal(rejected.headers['retry-after'], '1')

  limited = false
  await correctedRetryExecutesOnce(t, app, store, 'rate-1',
    { method: 'POST', url: '/pay', headers: keyed('rate-1'), payload: { amount: 100 } }, route.runs)
})

t.test('a body over bodyLimit (413) is not recorded: the smaller retry with the same key executes', async (t) => {
  const { app, store } = await setup(t, {}, { bodyLimit: 64 })
  const route = payRoute(app)

  const rejected = await app.inject({
    method: 'POST', url: '/pay', headers: keyed('big-1'), payload: { amount: 100, note: 'x'.repeat(200) }
  })
  t.equal(rejected.statusCode, 413)
  t.match(rejected.json(), { code: 'FST_ERR_CTP_BODY_TOO_LARGE' })

  await correctedRetryExecutesOnce(t, app, store, 'big-1',
    { method: 'POST', url: '/pay', headers: keyed('big-1'), payload: { amount: 100 } }, route.runs)
})

t.test('a route-level bodyLimit 413 in raw fingerprint mode is not recorded either', async (t) => {
  const { app, store } = await setup(t, { fingerprint: 'raw' })
  const route = payRoute(app, { bodyLimit: 64 })

  const rejected = await app.inject({
    method: 'POST', url: '/pay', headers: keyed('big-2'), payload: { amount: 100, note: 'x'.repeat(200) }
  })
  t.equal(rejected.statusCode, 413)

  await correctedRetryExecutesOnce(t, app, store, 'big-2',
    { method: 'POST', url: '/pay', headers: keyed('big-2'), payload: { amount: 100 } }, route.runs)
})
