import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type IdempotencyOptions } from '../../lib/index.js'
import { keyed, PROBLEM_TYPE } from '../helpers/app.js'

/**
 * On a default Fastify instance (maxParamLength 100) the status route must
 * answer for every key the plugin accepts, and an over-long key gets the documented 400 problem,
 * not the router's 414.
 */

async function api (t: Test, options: IdempotencyOptions = {}): Promise<FastifyInstance> {
  const app = Fastify() // default router options on purpose
  t.teardown(() => app.close())
  await app.register(idempotency, { store: memoryStore({ purgeInterval: 0 }), scope: () => 'acct', statusRoute: '/idempotency-keys/:key', ...options })
  app.post('/payments', async (_request, reply) => reply.code(201).send({ ok: true }))
  return app
}

const post = (app: FastifyInstance, key: string): Promise<LightMyRequestResponse> =>
  app.inject({ method: 'POST', url: '/payments', headers: keyed(key), payload: {} })
const status = (app: FastifyInstance, path: string, method: 'GET' | 'HEAD' = 'GET'): Promise<LightMyRequestResponse> =>
  app.inject({ method, url: path })

t.test('every accepted key length, 1 to maxKeyLength, is found by the status route', async (t) => {
  const app = await api(t)
  for (const length of [1, 100, 101, 200, 255]) {
    const key = `${'k'.repeat(length - 1)}${length % 10}`
    t.equal((await post(app, key)).statusCode, 201, `${length}: the POST accepts it`)
    const res = await status(app, `/idempotency-keys/${encodeURIComponent(key)}`)
    t.equal(res.statusCode, 200, `${length}: 200`)
    t.same(res.json(), { state: 'completed', response: { status: 201 } }, `${length}: its record`)
    t.equal((await status(app, `/idempotency-keys/${key}`, 'HEAD')).statusCode, 200, `${length}: HEAD too`)
  }
  const unknown = await status(app, `/idempotency-keys/${'u'.repeat(200)}`)
  t.equal(unknown.statusCode, 404, 'a long key never used: the key-unknown problem')
  t.equal(unknown.json().type, PROBLEM_TYPE('key-unknown'))
})

t.test('a key longer than maxKeyLength gets the documented 400 key-invalid problem', async (t) => {
  const app = await api(t)
  for (const length of [256, 1000]) {
    const res = await status(app, `/idempotency-keys/${'k'.repeat(length)}`)
    t.equal(res.statusCode, 400, `${length}: 400, not the router's 414`)
    t.match(res.headers['content-type'], /^application\/problem\+json/)
    t.equal(res.json().type, PROBLEM_TYPE('key-invalid'))
    t.match(res.json().detail, /at most 255 characters/)
  }
})

t.test('a raised maxKeyLength is served as well (8,192 characters)', async (t) => {
  const app = await api(t, { maxKeyLength: 8192 })
  const key = 'x'.repeat(8192)
  t.equal((await post(app, key)).statusCode, 201)
  t.equal((await status(app, `/idempotency-keys/${key}`)).json().state, 'completed')
  t.equal((await status(app, `/idempotency-keys/${key}x`)).statusCode, 400)
})

t.test('a status path with segments after :key serves long keys, and leaves other paths to the app', async (t) => {
  const app = await api(t, { statusRoute: '/keys/:key/status' })
  app.get('/keys/:id/owner', async () => 'the app\'s own route')
  const key = 'l'.repeat(180)
  await post(app, key)
  t.equal((await status(app, `/keys/${key}/status`)).json().state, 'completed')
  t.equal((await status(app, '/keys/short/owner')).body, 'the app\'s own route', 'a sibling route of the app still answers')
  const elsewhere = await status(app, `/keys/${key}/other`)
  t.equal(elsewhere.statusCode, 404, 'a path that is not the status route is not found')
  t.equal(elsewhere.json().code, undefined, 'Fastify\'s own 404, not a key-unknown problem')
  t.notMatch(elsewhere.headers['content-type'], /problem/)
})

t.test('an encoded slash and a malformed percent-encoding behave as before in long keys', async (t) => {
  const app = await api(t)
  const key = `${'s'.repeat(120)}/tail`
  await post(app, key)
  t.equal((await status(app, `/idempotency-keys/${encodeURIComponent(key)}`)).json().state, 'completed', '%2F is part of the key')
  const bad = await status(app, `/idempotency-keys/${'b'.repeat(120)}%E0%A4%A`)
  t.equal(bad.statusCode, 400)
  t.equal(bad.json().code, 'FST_ERR_BAD_URL', 'Fastify\'s bad-URL answer, as for short keys')
})

t.test('statusRoute refuses a path the long-key route cannot mirror', async (t) => {
  for (const url of ['/keys/:key/:other', '/keys/*/:key', '/keys/:key/*']) {
    const app = Fastify()
    t.teardown(() => app.close())
    const err = await app.register(idempotency, { statusRoute: url }).then(() => null, (e: unknown) => e)
    t.match(err, { name: 'InvalidOptionError', option: 'option "statusRoute"' }, url)
  }
})
