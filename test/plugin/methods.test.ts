import type { FastifyInstance, HTTPMethods, LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import type { IdempotencyContext, IdempotencyOptions } from '../../lib/index.js'
import { buildApp, keyed, PROBLEM_TYPE } from '../helpers/app.js'

/*
 * Behaviour 15: GET, HEAD, OPTIONS, PUT and DELETE pass through untouched unless a route opts in;
 * POST and PATCH are protected by default; `methods` changes the default set; route config
 * `idempotency: true | false` opts a route in or out.
 */

interface Counted {
  readonly app: FastifyInstance
  /** Handler executions per route URL. */
  readonly runs: Map<string, number>
  /** request.idempotency of every request, in order. */
  readonly seen: Array<IdempotencyContext | null>
}

async function counted (t: Test, plugin: IdempotencyOptions = {}): Promise<Counted> {
  const app = await buildApp(t, { plugin })
  const runs = new Map<string, number>()
  const seen: Array<IdempotencyContext | null> = []
  app.addHook('onResponse', async (request) => { seen.push(request.idempotency) })
  return { app, runs, seen }
}

/** A handler that counts its runs and answers 200 with the count (so a replay is visible). */
function handler (c: Counted, name: string) {
  return async () => {
    const n = (c.runs.get(name) ?? 0) + 1
    c.runs.set(name, n)
    return { route: name, run: n }
  }
}

function send (app: FastifyInstance, method: HTTPMethods, url: string, key = '"k-1"'): Promise<LightMyRequestResponse> {
  const withBody = method !== 'GET' && method !== 'HEAD' && method !== 'OPTIONS'
  return app.inject({
    method,
    url,
    headers: { 'idempotency-key': key, ...(withBody ? { 'content-type': 'application/json' } : {}) },
    ...(withBody ? { payload: { amount: 1 } } : {})
  })
}

/** Asserts that three identical keyed requests all ran the handler and none was touched by the plugin. */
async function assertPassThrough (t: Test, c: Counted, method: HTTPMethods, url: string, name = url): Promise<void> {
  const before = c.runs.get(name) ?? 0
  const seenBefore = c.seen.length
  for (let i = 0; i < 3; i++) {
    const res = await send(c.app, method, url)
    t.equal(res.statusCode, 200, `${method} ${url} #${i + 1}: 200`)
    t.equal(res.headers['idempotent-replayed'], undefined, `${method} ${url} #${i + 1}: not a replay`)
  }
  t.equal((c.runs.get(name) ?? 0) - before, 3, `${method} ${url}: the handler ran every time`)
  t.same(c.seen.slice(seenBefore), [null, null, null], `${method} ${url}: request.idempotency is null`)

  const invalid = await send(c.app, method, url, '"unterminated')
  t.equal(invalid.statusCode, 200, `${method} ${url}: an invalid key is not even looked at`)
  t.equal((c.runs.get(name) ?? 0) - before, 4)
}

/** Asserts that a keyed request runs once and its duplicate is replayed. */
async function assertProtected (t: Test, c: Counted, method: HTTPMethods, url: string, name = url, key = `"k-${method}"`): Promise<void> {
  const before = c.runs.get(name) ?? 0
  const first = await send(c.app, method, url, key)
  t.equal(first.statusCode, 200, `${method} ${url}: executed`)
  t.equal(first.headers['idempotent-replayed'], undefined)
  const second = await send(c.app, method, url, key)
  t.equal(second.statusCode, 200, `${method} ${url}: duplicate answered`)
  t.equal(second.headers['idempotent-replayed'], 'true', `${method} ${url}: duplicate replayed`)
  t.equal(second.body, first.body, `${method} ${url}: same body`)
  t.equal((c.runs.get(name) ?? 0) - before, 1, `${method} ${url}: the handler ran once`)

  const invalid = await send(c.app, method, url, '"unterminated')
  t.equal(invalid.statusCode, 400, `${method} ${url}: an invalid key is refused`)
  t.equal(invalid.json<{ type: string }>().type, PROBLEM_TYPE('key-invalid'))
  t.equal((c.runs.get(name) ?? 0) - before, 1)
}

for (const method of ['GET', 'PUT', 'DELETE', 'OPTIONS'] as const) {
  t.test(`${method} with an Idempotency-Key passes through untouched by default`, async (t) => {
    const c = await counted(t)
    c.app.route({ method, url: '/r', handler: handler(c, '/r') })
    await assertPassThrough(t, c, method, '/r')
  })
}

t.test('HEAD with an Idempotency-Key passes through untouched by default', async (t) => {
  const c = await counted(t)
  c.app.route({ method: 'HEAD', url: '/r', handler: handler(c, '/r') })
  await assertPassThrough(t, c, 'HEAD', '/r')
})

t.test('the HEAD route Fastify derives from a GET route passes through too', async (t) => {
  const c = await counted(t)
  c.app.get('/r', handler(c, '/r'))
  await assertPassThrough(t, c, 'HEAD', '/r')
})

t.test('POST is protected by default: a duplicate is replayed', async (t) => {
  const c = await counted(t)
  c.app.post('/r', handler(c, '/r'))
  await assertProtected(t, c, 'POST', '/r')
})

t.test('PATCH is protected by default: a duplicate is replayed', async (t) => {
  const c = await counted(t)
  c.app.patch('/r', handler(c, '/r'))
  await assertProtected(t, c, 'PATCH', '/r')
})

t.test('config: { idempotency: true } opts a PUT route in', async (t) => {
  const c = await counted(t)
  c.app.put('/r', { config: { idempotency: true } }, handler(c, '/r'))
  await assertProtected(t, c, 'PUT', '/r')
})

t.test('config: { idempotency: true } opts a DELETE route in', async (t) => {
  const c = await counted(t)
  c.app.delete('/r', { config: { idempotency: true } }, handler(c, '/r'))
  await assertProtected(t, c, 'DELETE', '/r')
})

t.test('an object config opts a PUT route in as well', async (t) => {
  const c = await counted(t)
  c.app.put('/r', { config: { idempotency: { required: true } } }, handler(c, '/r'))
  await assertProtected(t, c, 'PUT', '/r')
  const missing = await c.app.inject({ method: 'PUT', url: '/r', payload: {} })
  t.equal(missing.statusCode, 400)
})

t.test('config: { idempotency: false } opts a POST route out', async (t) => {
  const c = await counted(t, { required: true })
  c.app.post('/r', { config: { idempotency: false } }, handler(c, '/r'))
  await assertPassThrough(t, c, 'POST', '/r')
  const missing = await c.app.inject({ method: 'POST', url: '/r', payload: {} })
  t.equal(missing.statusCode, 200, 'not even `required` applies to an opted-out route')
})

t.test('a route declared for GET and POST protects only its POST', async (t) => {
  const c = await counted(t)
  c.app.route({ method: ['GET', 'POST'], url: '/r', handler: handler(c, '/r') })
  await assertPassThrough(t, c, 'GET', '/r')
  await assertProtected(t, c, 'POST', '/r')
  await assertPassThrough(t, c, 'GET', '/r')
})

t.test('the methods option replaces the default set: PUT protected, PATCH not', async (t) => {
  const c = await counted(t, { methods: ['POST', 'PUT'] })
  c.app.post('/post', handler(c, '/post'))
  c.app.put('/put', handler(c, '/put'))
  c.app.patch('/patch', handler(c, '/patch'))
  await assertProtected(t, c, 'POST', '/post')
  await assertProtected(t, c, 'PUT', '/put')
  await assertPassThrough(t, c, 'PATCH', '/patch')
})

t.test('with a custom methods set, a route can still opt out and another method opt in', async (t) => {
  const c = await counted(t, { methods: ['POST', 'PUT'] })
  c.app.put('/put-out', { config: { idempotency: false } }, handler(c, '/put-out'))
  c.app.patch('/patch-in', { config: { idempotency: true } }, handler(c, '/patch-in'))
  await assertPassThrough(t, c, 'PUT', '/put-out')
  await assertProtected(t, c, 'PATCH', '/patch-in')
})

t.test('methods are matched case-insensitively', async (t) => {
  const c = await counted(t, { methods: ['put'] })
  c.app.put('/put', handler(c, '/put'))
  c.app.post('/post', handler(c, '/post'))
  await assertProtected(t, c, 'PUT', '/put')
  await assertPassThrough(t, c, 'POST', '/post')
})

t.test('the same key on a protected POST and an unprotected GET does not interact', async (t) => {
  const c = await counted(t)
  c.app.get('/r', handler(c, 'get'))
  c.app.post('/r', handler(c, 'post'))
  const post = await c.app.inject({ method: 'POST', url: '/r', headers: keyed('shared'), payload: {} })
  t.equal(post.statusCode, 200)
  const get = await c.app.inject({ method: 'GET', url: '/r', headers: { 'idempotency-key': '"shared"' } })
  t.equal(get.statusCode, 200)
  t.equal(get.headers['idempotent-replayed'], undefined, 'the GET is not answered from the POST record')
  t.same(get.json(), { route: 'get', run: 1 })
})
