import swagger from '@fastify/swagger'
import type { FastifyInstance, FastifyRequest, LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import { InvalidOptionError, memoryStore, type IdempotencyOptions, type KeyFunction, type RouteIdempotencyOptions } from '../../lib/index.js'
import { buildApp, PROBLEM_TYPE } from '../helpers/app.js'
import { countingStore } from './counting-store.js'

/*
 * The route option `key`: the key from somewhere other than the Idempotency-Key header (a
 * webhook's delivery id in another header, its event id in the parsed body). Asserted on what a
 * sender sees (status, body, headers) and on what ran (handler executions, store calls).
 */

interface Route {
  readonly app: FastifyInstance
  /** Handler executions so far. */
  readonly runs: () => number
  /** Store calls so far, once the app booted (the boot check is not counted). */
  readonly storeCalls: () => number
  /** `request.idempotency` as each execution saw it: null when the request ran unprotected. */
  readonly contexts: Array<{ key: string } | null>
}

/** POST /hook with `config.idempotency` = `options`, on a counting memory store; it answers 200 with its execution number. */
async function hookRoute (t: Test, options: RouteIdempotencyOptions, plugin: IdempotencyOptions = {}, setup?: (app: FastifyInstance) => void): Promise<Route> {
  const counted = countingStore(memoryStore({ purgeInterval: 0 }))
  t.teardown(() => counted.store.close())
  const app = await buildApp(t, { plugin: { store: counted.store, ...plugin } })
  let runs = 0
  const contexts: Array<{ key: string } | null> = []
  app.post('/hook', { config: { idempotency: options } }, async (request) => {
    runs++
    contexts.push(request.idempotency === null ? null : { key: request.idempotency.key })
    return { execution: runs }
  })
  setup?.(app)
  await app.ready()
  counted.reset()
  return { app, runs: () => runs, storeCalls: counted.total, contexts }
}

const fromHeader = (name: string): KeyFunction => (request) => {
  const value = request.headers[name]
  return typeof value === 'string' ? value : undefined
}

function deliver (app: FastifyInstance, headers: Record<string, string>, payload: Record<string, unknown> = { type: 'paid' }): Promise<LightMyRequestResponse> {
  return app.inject({ method: 'POST', url: '/hook', headers: { 'content-type': 'application/json', ...headers }, payload })
}

function assertProblem (t: Test, res: LightMyRequestResponse, status: number, kind: string, detail?: RegExp): void {
  t.equal(res.statusCode, status, res.body)
  t.match(String(res.headers['content-type']), /^application\/problem\+json/, 'a problem document')
  const body = res.json() as { type?: string, status?: number, detail?: string }
  t.equal(body.type, PROBLEM_TYPE(kind))
  t.equal(body.status, status)
  if (detail !== undefined) t.match(body.detail, detail)
}

t.test('the key from another header: one execution per delivery id, replayed to a redelivery', async (t) => {
  const { app, runs, contexts } = await hookRoute(t, { key: fromHeader('webhook-id') })
  const first = await deliver(app, { 'webhook-id': 'msg_1' })
  t.equal(first.statusCode, 200)
  t.same(first.json(), { execution: 1 })
  t.equal(first.headers['idempotent-replayed'], undefined)
  const again = await deliver(app, { 'webhook-id': 'msg_1' })
  t.equal(again.statusCode, 200)
  t.equal(again.headers['idempotent-replayed'], 'true')
  t.equal(again.body, first.body, 'the recorded answer, byte for byte')
  const other = await deliver(app, { 'webhook-id': 'msg_2' })
  t.same(other.json(), { execution: 2 }, 'another id is another operation')
  t.equal(runs(), 2)
  t.same(contexts, [{ key: 'msg_1' }, { key: 'msg_2' }], 'request.idempotency.key is the function\'s value')
})

t.test('the key from the parsed body: the same event id with the same body replays, with another body is 422', async (t) => {
  const { app, runs } = await hookRoute(t, { key: (request: FastifyRequest) => (request.body as { id?: string } | undefined)?.id })
  const first = await deliver(app, {}, { id: 'evt_1', amount: 10 })
  t.same(first.json(), { execution: 1 })
  const again = await deliver(app, {}, { amount: 10, id: 'evt_1' })
  t.equal(again.headers['idempotent-replayed'], 'true', 'the same event (members in another order) is a redelivery')
  t.same(again.json(), { execution: 1 })
  const changed = await deliver(app, {}, { id: 'evt_1', amount: 11 })
  assertProblem(t, changed, 422, 'key-reused')
  t.equal(runs(), 1)
})

t.test('the key is taken verbatim: quotes are part of it, not Structured Field syntax', async (t) => {
  const { app, runs, contexts } = await hookRoute(t, { key: fromHeader('x-delivery') })
  const quoted = await deliver(app, { 'x-delivery': '"abc"' })
  t.same(quoted.json(), { execution: 1 })
  const bare = await deliver(app, { 'x-delivery': 'abc' })
  t.same(bare.json(), { execution: 2 }, '"abc" and abc are two keys')
  t.equal(bare.headers['idempotent-replayed'], undefined)
  const escaped = await deliver(app, { 'x-delivery': '"a\\"b"' })
  t.same(escaped.json(), { execution: 3 }, 'an sf-string escape is not unescaped either')
  const quotedAgain = await deliver(app, { 'x-delivery': '"abc"' })
  t.equal(quotedAgain.headers['idempotent-replayed'], 'true')
  t.same(quotedAgain.json(), { execution: 1 })
  t.equal(runs(), 3)
  t.same(contexts.map((c) => c?.key), ['"abc"', 'abc', '"a\\"b"'])
  // A value the header parser would refuse (a space, a comma) is a key here.
  const spaced = await deliver(app, { 'x-delivery': 'a b, c' })
  t.equal(spaced.statusCode, 200)
  t.equal(runs(), 4)
})

t.test('a key longer than maxKeyLength is a 400 key-invalid problem; one of exactly maxKeyLength runs', async (t) => {
  const { app, runs, storeCalls } = await hookRoute(t, { key: fromHeader('webhook-id'), maxKeyLength: 8 })
  const long = await deliver(app, { 'webhook-id': '123456789' })
  assertProblem(t, long, 400, 'key-invalid', /at most 8 characters/)
  t.equal(runs(), 0)
  t.equal(storeCalls(), 0, 'the store was not asked')
  const exact = await deliver(app, { 'webhook-id': '12345678' })
  t.equal(exact.statusCode, 200)
  t.equal(runs(), 1)
})

t.test('a key with a control character is a 400 key-invalid problem, and the store is not asked', async (t) => {
  for (const key of ['evt\u0000', 'evt\nx', 'evt\u001f', 'evt\u007f']) {
    const { app, runs, storeCalls } = await hookRoute(t, { key: (request) => (request.body as { id: string }).id })
    const res = await deliver(app, {}, { id: key })
    assertProblem(t, res, 400, 'key-invalid', /control characters/)
    t.equal(runs(), 0, `${JSON.stringify(key)}: the handler did not run`)
    t.equal(storeCalls(), 0, `${JSON.stringify(key)}: no store call`)
  }
})

t.test('a key with a C1 control or an unpaired surrogate is a 400 key-invalid problem; well-formed non-ASCII keys run', async (t) => {
  // A lone surrogate (from a JSON body's "\\ud800") has no UTF-8 form: PostgreSQL would store U+FFFD,
  // and "evt_\\ud800" and "evt_\\udbff" would be one key there.
  for (const key of ['evt\u0085', 'evt\u009b[31m', 'evt_\ud800', 'evt_\udbff', 'evt_\udc00\ud800']) {
    const { app, runs, storeCalls } = await hookRoute(t, { key: (request) => (request.body as { id: string }).id })
    const res = await deliver(app, {}, { id: key })
    assertProblem(t, res, 400, 'key-invalid', /control characters or unpaired surrogates/)
    t.equal(runs(), 0, `${JSON.stringify(key)}: the handler did not run`)
    t.equal(storeCalls(), 0, `${JSON.stringify(key)}: no store call`)
  }
  const { app, runs, contexts } = await hookRoute(t, { key: (request) => (request.body as { id: string }).id })
  for (const key of ['évt_1', 'evt_\ud83d\ude00', 'evt_\u00a0']) {
    t.equal((await deliver(app, {}, { id: key })).statusCode, 200, `${JSON.stringify(key)}: a key`)
  }
  t.equal(runs(), 3)
  t.same(contexts.map((c) => c?.key), ['évt_1', 'evt_😀', 'evt_\u00a0'])
})

t.test('an empty key is a 400 key-invalid problem', async (t) => {
  const { app, runs } = await hookRoute(t, { key: () => '' })
  assertProblem(t, await deliver(app, {}), 400, 'key-invalid', /must not be empty/)
  t.equal(runs(), 0)
})

t.test('no key (undefined) with required: a 400 key-missing problem, the handler never runs', async (t) => {
  const { app, runs, storeCalls } = await hookRoute(t, { key: fromHeader('webhook-id'), required: true })
  const res = await deliver(app, {})
  assertProblem(t, res, 400, 'key-missing', /carries none where this route looks for it/)
  t.equal(runs(), 0)
  t.equal(storeCalls(), 0)
})

t.test('no key (undefined) without required: the request runs unprotected, every time', async (t) => {
  const { app, runs, storeCalls, contexts } = await hookRoute(t, { key: fromHeader('webhook-id') })
  const first = await deliver(app, {})
  const second = await deliver(app, {})
  t.same([first.statusCode, second.statusCode], [200, 200])
  t.same([first.json(), second.json()], [{ execution: 1 }, { execution: 2 }], 'the handler ran each time')
  t.equal(second.headers['idempotent-replayed'], undefined, 'no replay')
  t.same(contexts, [null, null], 'request.idempotency is null')
  t.equal(storeCalls(), 0, 'the store was not asked')
  t.equal(runs(), 2)
})

t.test('a key function that returns a non-string, or throws, ends in the error handler (500); the store never sees a claim', async (t) => {
  const cases: ReadonlyArray<readonly [string, KeyFunction]> = [
    ['a number', () => 42 as unknown as string],
    ['null', () => null as unknown as string],
    ['an array', () => ['evt_1', 'evt_2'] as unknown as string],
    ['a promise', (async () => 'evt_1') as unknown as KeyFunction],
    ['a throw', () => { throw new Error('no id here') }]
  ]
  for (const [what, key] of cases) {
    const errors: Error[] = []
    const { app, runs, storeCalls } = await hookRoute(t, { key }, {}, (app) => {
      app.setErrorHandler((err, _request, reply) => { errors.push(err as Error); return reply.code(500).send({ error: 'internal' }) })
    })
    const res = await deliver(app, {})
    t.equal(res.statusCode, 500, `${what}: 500`)
    t.equal(errors.length, 1, `${what}: through the app's error handler`)
    t.equal(runs(), 0, `${what}: the handler did not run`)
    t.equal(storeCalls(), 0, `${what}: no store call`)
  }
})

t.test('the error of a key function that returns a non-string names the route\'s key function and the value\'s kind', async (t) => {
  const logged: string[] = []
  const { app } = await hookRoute(t, { key: () => 42 as unknown as string }, {}, (app) => {
    app.setErrorHandler((err, _request, reply) => { logged.push((err as Error).message); return reply.code(500).send() })
  })
  t.equal((await deliver(app, {})).statusCode, 500)
  t.match(logged[0], /key function must return a string or undefined; it returned 42/)
})

t.test('the Idempotency-Key header is not read on a route with a key option', async (t) => {
  const { app, runs } = await hookRoute(t, { key: fromHeader('webhook-id') })
  const a = await deliver(app, { 'webhook-id': 'msg_a', 'idempotency-key': '"same"' })
  const b = await deliver(app, { 'webhook-id': 'msg_b', 'idempotency-key': '"same"' })
  t.same([a.json(), b.json()], [{ execution: 1 }, { execution: 2 }], 'one Idempotency-Key, two ids: two executions')
  t.equal(b.headers['idempotent-replayed'], undefined)
  const malformed = await deliver(app, { 'webhook-id': 'msg_c', 'idempotency-key': 'not a valid, key' })
  t.equal(malformed.statusCode, 200, 'a malformed header is not refused: nothing reads it')
  const onlyHeader = await hookRoute(t, { key: fromHeader('webhook-id'), required: true })
  assertProblem(t, await deliver(onlyHeader.app, { 'idempotency-key': '"k"' }), 400, 'key-missing')
  t.equal(onlyHeader.runs(), 0, 'the header does not stand in for a missing id')
  t.equal(runs(), 3)
})

t.test('the key option given at the plugin applies to every protected route', async (t) => {
  const { app, runs } = await hookRoute(t, {}, { key: fromHeader('webhook-id') })
  await deliver(app, { 'webhook-id': 'msg_1' })
  const again = await deliver(app, { 'webhook-id': 'msg_1' })
  t.equal(again.headers['idempotent-replayed'], 'true')
  t.equal(runs(), 1)
})

t.test('a key option that is not a function is refused when the route is added, naming config.idempotency.key and the value', async (t) => {
  const values: ReadonlyArray<readonly [unknown, string]> = [
    ['webhook-id', 'received a string of 10 characters'],
    [true, 'received true'],
    [null, 'received null']
  ]
  for (const [value, described] of values) {
    const app = await buildApp(t)
    let runs = 0
    let thrown: unknown = null
    try {
      app.post('/hook', { config: { idempotency: { key: value as KeyFunction } } }, async () => { runs++; return {} })
    } catch (err) {
      thrown = err
    }
    t.ok(thrown instanceof InvalidOptionError, `${String(value)}: an InvalidOptionError`)
    t.match((thrown as Error | null)?.message, 'route POST /hook config.idempotency.key must be a function', `${String(value)}: names the option`)
    t.match((thrown as Error | null)?.message, described, `${String(value)}: describes the value`)
    const res = await app.inject({ method: 'POST', url: '/hook', headers: { 'webhook-id': 'msg_1' }, payload: {} })
    t.equal(res.statusCode, 404, 'the route was not added unprotected')
    t.equal(runs, 0)
  }
  t.rejects(async () => {
    await buildApp(t, { plugin: { key: 'webhook-id' as unknown as KeyFunction } })
  }, { name: 'InvalidOptionError', message: /option "key" must be a function; received a string of 10 characters/ }, 'at the plugin too')
})

t.test('OpenAPI: a route with a key option documents no Idempotency-Key header, and still its 409 and 422', async (t) => {
  const app = await buildApp(t)
  await app.register(swagger, { openapi: { openapi: '3.0.3', info: { title: 'webhooks', version: '1.0.0' } } })
  app.post('/hook', { config: { idempotency: { key: fromHeader('webhook-id'), required: true } } }, async () => ({ received: true }))
  app.post('/payments', { config: { idempotency: { required: true } } }, async () => ({ ok: true }))
  await app.ready()
  interface Operation { parameters?: Array<{ in: string, name: string }>, responses: Record<string, { description?: string } | undefined> }
  const paths = (app.swagger() as unknown as { paths: Record<string, Record<string, Operation>> }).paths
  const keyHeaders = (op: Operation | undefined): string[] =>
    (op?.parameters ?? []).filter((p) => p.in === 'header' && p.name.toLowerCase() === 'idempotency-key').map((p) => p.name)
  t.same(keyHeaders(paths['/hook']?.post), [], 'no Idempotency-Key parameter on the webhook route')
  t.same(keyHeaders(paths['/payments']?.post), ['idempotency-key'], 'the header route beside it documents it (the check can fail)')
  t.ok(paths['/hook']?.post?.responses['409'], '409 documented')
  t.ok(paths['/hook']?.post?.responses['422'], '422 documented')
  const refused = paths['/hook']?.post?.responses['400']?.description
  t.notMatch(refused, /header/, `the 400s do not speak of a header the route does not read (${String(refused)})`)
  t.match(refused, /carries no key where this operation looks for one/, 'key-missing')
  t.match(refused, /not valid: empty, longer than 255 characters/, 'key-invalid, with the route\'s maxKeyLength')
  t.match(paths['/payments']?.post?.responses['400']?.description, /The Idempotency-Key header is missing/, 'the header route keeps its own')
  const res = await app.inject({ method: 'POST', url: '/hook', headers: { 'webhook-id': 'msg_1' }, payload: {} })
  t.equal(res.statusCode, 200, 'the documented schema does not require the header')
})
