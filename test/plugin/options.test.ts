import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { InvalidOptionError, memoryStore, type IdempotencyOptions } from '../../lib/index.js'
import { buildApp, keyed, manualClock, PROBLEM_TYPE } from '../helpers/app.js'

/*
 * Options are validated once, at registration (global) or when a route is added (route config); a
 * bad value is an InvalidOptionError naming the option and describing the value received (a number
 * or boolean as it is, anything else by its kind: test/plugin/option-errors.test.ts), never a silent
 * fallback. Valid route overrides take effect on their route only.
 */

const CODE = 'FST_IDEMPOTENCY_INVALID_OPTION'

/**
 * Registers the plugin on a fresh instance and boots it. The registration is synchronous, so a short
 * plugin timeout never fires for a working plugin; it only bounds a registration that never settles
 * (an error escaping avvio instead of reaching done(err)), which then fails the assertions below
 * with avvio's timeout error instead of hanging the file.
 */
async function register (t: Test, options: unknown): Promise<FastifyInstance> {
  const app = Fastify({ pluginTimeout: 500 })
  t.teardown(() => app.close())
  await app.register(idempotency, options as IdempotencyOptions)
  await app.ready()
  return app
}

/** Asserts that `promise` rejects with an InvalidOptionError whose message contains every fragment. */
async function rejectsInvalid (t: Test, thenable: PromiseLike<unknown>, fragments: readonly string[]): Promise<void> {
  const promise = Promise.resolve(thenable)
  await t.rejects(promise, { name: 'InvalidOptionError', code: CODE }, 'an InvalidOptionError')
  const err = await promise.then(() => null, (e: unknown) => e)
  t.ok(err instanceof InvalidOptionError, 'an instance of the exported InvalidOptionError')
  t.ok(err instanceof TypeError, 'a TypeError')
  const message = err instanceof Error ? err.message : ''
  for (const fragment of fragments) t.ok(message.includes(fragment), `the message shows ${fragment}`, { message })
}

const BAD_GLOBAL: ReadonlyArray<readonly [string, Record<string, unknown>, readonly string[]]> = [
  ['ttl is not a number', { ttl: 'abc' }, ['"ttl"', 'received a string of 3 characters']],
  ['ttl is 0', { ttl: 0 }, ['"ttl"', 'received 0']],
  ['lease is negative', { lease: -1 }, ['"lease"', '-1']],
  ['lease is longer than ttl', { ttl: 1000, lease: 2000 }, ['"lease"', '2000']],
  ['wait is not an integer', { wait: 1.5 }, ['"wait"', '1.5']],
  ['maxKeyLength is 0', { maxKeyLength: 0 }, ['"maxKeyLength"', 'received 0']],
  ['keyFormat is unknown', { keyFormat: 'loose' }, ['"keyFormat"', "one of 'lenient', 'strict'; received a string of 5 characters"]],
  ['fingerprint is unknown', { fingerprint: 'sha1' }, ['"fingerprint"', 'received a string of 4 characters']],
  ['record is not a function', { record: 'yes' }, ['"record"', 'a function; received a string of 3 characters']],
  ['scope is not a function', { scope: 'tenant' }, ['"scope"', 'a function; received a string of 6 characters']],
  ['required is a string', { required: 'true' }, ['"required"', 'true or false; received a string of 4 characters']],
  ['methods is empty', { methods: [] }, ['"methods"', 'received an array of 0 items']],
  ['methods holds an unknown method', { methods: ['FETCH'] }, ['"methods"', 'received a string of 5 characters']],
  ['methods is a string', { methods: 'POST' }, ['"methods"', 'received a string of 4 characters']],
  ['replayHeaders holds set-cookie', { replayHeaders: ['set-cookie'] }, ['"replayHeaders"', "'set-cookie'"]],
  ['replayHeaders is a string', { replayHeaders: 'content-type' }, ['"replayHeaders"', 'an array of header names; received a string of 12 characters']],
  ['onStoreError is unknown', { onStoreError: 'ignore' }, ['"onStoreError"', 'received a string of 6 characters']],
  ['storeTimeout is 0', { storeTimeout: 0 }, ['"storeTimeout"', 'received 0']],
  ['retryAfter is negative', { retryAfter: -1 }, ['"retryAfter"', '-1']],
  ['problemTypeBase is not a URI', { problemTypeBase: 'not a uri' }, ['"problemTypeBase"', 'received a string of 9 characters']],
  ['docsUrl is not http(s)', { docsUrl: 'ftp://x' }, ['"docsUrl"', 'received a string of 7 characters']],
  ['store lacks every method', { store: {} }, ['"store"', 'claim', 'complete', 'release', 'renew', 'get', 'purgeExpired', 'close', 'received an object with no properties']],
  ['the store\'s optional check is not a function', { store: { ...memoryStore({ purgeInterval: 0 }), check: 'yes' } }, ['option "store".check must be a function when present', 'received a string of 3 characters']],
  ['an option name is misspelt', { ttL: 1000 }, ['option "ttL" must be one of', 'received 1000']]
]

for (const [what, options, fragments] of BAD_GLOBAL) {
  t.test(`registration fails when ${what}, naming the option and the value`, async (t) => {
    await rejectsInvalid(t, register(t, { scope: () => 's', ...options }), fragments)
  })
}

t.test('a store missing some methods is refused, naming exactly the missing ones', async (t) => {
  const full = memoryStore({ purgeInterval: 0 })
  t.teardown(() => full.close())
  const partial = { claim: full.claim, complete: full.complete, get: full.get, close: full.close }
  const promise = register(t, { scope: () => 's', store: partial })
  await rejectsInvalid(t, promise, ['"store"', 'release', 'renew', 'purgeExpired'])
  const err = await promise.then(() => null, (e: unknown) => e)
  t.notMatch(err instanceof Error ? err.message : '', /missing[^;]*\bclaim\b/, 'present methods are not listed as missing')
})

t.test('valid options register and take effect', async (t) => {
  const app = Fastify({ pluginTimeout: 500 })
  t.teardown(() => app.close())
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  await app.register(idempotency, {
    scope: () => 's',
    store,
    ttl: 60_000,
    lease: 5_000,
    wait: 100,
    maxKeyLength: 1024,
    keyFormat: 'strict',
    fingerprint: 'raw',
    record: (status: number) => status < 400,
    methods: ['POST', 'PUT'],
    required: true,
    replayHeaders: ['content-type', 'location', 'x-request-id'],
    onStoreError: 'bypass',
    storeTimeout: 1000,
    retryAfter: 0,
    maxResponseBytes: 1024,
    problemTypeBase: 'https://errors.example.com/',
    docsUrl: 'https://docs.example.com/idempotency'
  })
  let runs = 0
  app.post('/x', async (_request, reply) => { reply.header('x-request-id', `req-${++runs}`); return { run: runs } })
  const missing = await app.inject({ method: 'POST', url: '/x', payload: {} })
  t.equal(missing.statusCode, 400, 'required: true took effect')
  t.equal(missing.json<{ type: string }>().type, 'https://errors.example.com/key-missing', 'problemTypeBase took effect')
  t.equal(missing.headers.link, '<https://docs.example.com/idempotency>; rel="describedby"; type="text/html"', 'docsUrl took effect')
  const bare = await app.inject({ method: 'POST', url: '/x', headers: { 'idempotency-key': 'bare' }, payload: {} })
  t.equal(bare.statusCode, 400, 'keyFormat: strict took effect')
  const first = await app.inject({ method: 'POST', url: '/x', headers: keyed('k'), payload: {} })
  const second = await app.inject({ method: 'POST', url: '/x', headers: keyed('k'), payload: {} })
  t.equal(second.headers['idempotent-replayed'], 'true')
  t.equal(second.headers['x-request-id'], first.headers['x-request-id'], 'replayHeaders took effect')
  t.equal(runs, 1)
})

// ---------------------------------------------------------------------------------------------
// Route config
// ---------------------------------------------------------------------------------------------

const BAD_ROUTE: ReadonlyArray<readonly [string, unknown, readonly string[]]> = [
  ['a negative ttl', { ttl: -5 }, ['route POST /x config.idempotency.ttl', '-5']],
  ['a store (not a route option)', { store: memoryStore({ purgeInterval: 0 }) }, ['route POST /x config.idempotency.store']],
  ['methods (not a route option)', { methods: ['PUT'] }, ['route POST /x config.idempotency.methods']],
  ['a string', 'yes', ['route POST /x config.idempotency', 'received a string of 3 characters']],
  ['an unknown keyFormat', { keyFormat: 'loose' }, ['route POST /x config.idempotency.keyFormat', 'received a string of 5 characters']],
  ['a lease longer than its ttl', { ttl: 1000, lease: 2000 }, ['route POST /x config.idempotency.lease', '2000']]
]

for (const [what, config, fragments] of BAD_ROUTE) {
  t.test(`a route config with ${what} throws from app.post once the plugin is loaded, naming the route`, async (t) => {
    const app = await buildApp(t)
    let runs = 0
    let thrown: unknown = null
    try {
      app.post('/x', { config: { idempotency: config as boolean } }, async () => { runs++; return {} })
    } catch (err) {
      thrown = err
    }
    await rejectsInvalid(t, thrown === null ? Promise.resolve('did not throw') : Promise.reject(thrown), fragments)
    const res = await app.inject({ method: 'POST', url: '/x', headers: keyed('k'), payload: {} })
    t.equal(res.statusCode, 404, 'the route was not added unprotected')
    t.equal(runs, 0)
  })

  t.test(`a route config with ${what} inside a child plugin fails ready(), naming the route`, async (t) => {
    const app = Fastify()
    t.teardown(() => app.close())
    app.register(idempotency, { scope: () => 's', store: memoryStore({ purgeInterval: 0 }) })
    app.register(async (child) => {
      child.post('/x', { config: { idempotency: config as boolean } }, async () => ({}))
    })
    await rejectsInvalid(t, app.ready(), fragments)
  })
}

t.test('a route config error names the route\'s method and URL, with its prefix', async (t) => {
  const app = Fastify()
  t.teardown(() => app.close())
  app.register(idempotency, { scope: () => 's', store: memoryStore({ purgeInterval: 0 }) })
  app.register(async (child) => {
    child.put('/orders/:id', { config: { idempotency: { wait: -1 } } }, async () => ({}))
  }, { prefix: '/v1' })
  await rejectsInvalid(t, app.ready(), ['route PUT /v1/orders/:id config.idempotency.wait', '-1'])
})

/** Sends a keyed POST with a JSON body. */
function post (app: FastifyInstance, url: string, key: string, payload: string | Record<string, unknown> = { amount: 1 }, headers: Record<string, string> = {}): Promise<LightMyRequestResponse> {
  return app.inject({ method: 'POST', url, headers: { ...keyed(key), ...headers }, payload })
}

t.test('a route ttl overrides the global one on that route only', async (t) => {
  const clock = manualClock()
  const app = await buildApp(t, { memory: { now: clock.now } })
  const runs = { short: 0, long: 0 }
  app.post('/short', { config: { idempotency: { ttl: 1000, lease: 1000 } } }, async () => ({ run: ++runs.short }))
  app.post('/long', async () => ({ run: ++runs.long }))
  await post(app, '/short', 'k-short')
  await post(app, '/long', 'k-long')
  clock.advance(999)
  t.equal((await post(app, '/short', 'k-short')).headers['idempotent-replayed'], 'true', 'still retained before the route ttl')
  clock.advance(2)
  const expired = await post(app, '/short', 'k-short')
  t.equal(expired.headers['idempotent-replayed'], undefined, 'after the route ttl the key executes as new')
  t.same(expired.json(), { run: 2 })
  const kept = await post(app, '/long', 'k-long')
  t.equal(kept.headers['idempotent-replayed'], 'true', 'the other route keeps the default 24 h')
  t.same(runs, { short: 2, long: 1 })
})

t.test('a route can be required while others are not', async (t) => {
  const app = await buildApp(t)
  let runs = 0
  app.post('/required', { config: { idempotency: { required: true } } }, async () => ({ run: ++runs }))
  app.post('/optional', async () => ({ run: ++runs }))
  const refused = await app.inject({ method: 'POST', url: '/required', payload: {} })
  t.equal(refused.statusCode, 400)
  t.equal(refused.json<{ type: string }>().type, PROBLEM_TYPE('key-missing'))
  t.equal(runs, 0)
  const passed = await app.inject({ method: 'POST', url: '/optional', payload: {} })
  t.equal(passed.statusCode, 200)
  t.equal(runs, 1)
})

t.test('a route can be required: false under a required: true registration', async (t) => {
  const app = await buildApp(t, { plugin: { required: true } })
  let runs = 0
  app.post('/optional', { config: { idempotency: { required: false } } }, async () => ({ run: ++runs }))
  app.post('/required', async () => ({ run: ++runs }))
  t.equal((await app.inject({ method: 'POST', url: '/optional', payload: {} })).statusCode, 200)
  t.equal((await app.inject({ method: 'POST', url: '/required', payload: {} })).statusCode, 400)
  t.equal(runs, 1)
})

t.test('a route keyFormat: strict refuses bare keys on that route only', async (t) => {
  const app = await buildApp(t)
  let runs = 0
  app.post('/strict', { config: { idempotency: { keyFormat: 'strict' } } }, async () => ({ run: ++runs }))
  app.post('/lenient', async () => ({ run: ++runs }))
  const bare = { 'idempotency-key': 'bare-key-1', 'content-type': 'application/json' }
  const strict = await app.inject({ method: 'POST', url: '/strict', headers: bare, payload: {} })
  t.equal(strict.statusCode, 400)
  t.equal(strict.json<{ type: string }>().type, PROBLEM_TYPE('key-invalid'))
  t.equal((await app.inject({ method: 'POST', url: '/strict', headers: keyed('bare-key-1'), payload: {} })).statusCode, 200, 'the quoted key is fine')
  t.equal((await app.inject({ method: 'POST', url: '/lenient', headers: { ...bare, 'idempotency-key': 'bare-key-2' }, payload: {} })).statusCode, 200, 'the other route takes a bare key')
  t.equal(runs, 2)
})

t.test('a route fingerprint: raw tells reordered JSON members apart; the default canonical one does not', async (t) => {
  const app = await buildApp(t)
  const runs = { raw: 0, canonical: 0 }
  app.post('/raw', { config: { idempotency: { fingerprint: 'raw' } } }, async () => ({ run: ++runs.raw }))
  app.post('/canonical', async () => ({ run: ++runs.canonical }))
  for (const url of ['/raw', '/canonical']) t.equal((await post(app, url, `k${url}`, '{"a":1,"b":2}')).statusCode, 200)
  const raw = await post(app, '/raw', 'k/raw', '{"b":2,"a":1}')
  t.equal(raw.statusCode, 422, 'raw: different bytes, a different request')
  t.equal(raw.json<{ type: string }>().type, PROBLEM_TYPE('key-reused'))
  const canonical = await post(app, '/canonical', 'k/canonical', '{"b":2,"a":1}')
  t.equal(canonical.statusCode, 200, 'canonical: the same request')
  t.equal(canonical.headers['idempotent-replayed'], 'true')
  const rawSame = await post(app, '/raw', 'k/raw', '{"a":1,"b":2}')
  t.equal(rawSame.headers['idempotent-replayed'], 'true', 'raw: the same bytes replay')
  t.same(runs, { raw: 1, canonical: 1 })
})

t.test('a route scope overrides the global one', async (t) => {
  const app = await buildApp(t) // global scope: 'test' for everyone
  const runs = { scoped: 0, global: 0 }
  app.post('/scoped', { config: { idempotency: { scope: (request) => String(request.headers['x-tenant']) } } }, async (request) => ({ run: ++runs.scoped, scope: request.idempotency?.scope }))
  app.post('/global', async (request) => ({ run: ++runs.global, scope: request.idempotency?.scope }))

  const a = await post(app, '/scoped', 'same', {}, { 'x-tenant': 'acme' })
  const b = await post(app, '/scoped', 'same', {}, { 'x-tenant': 'globex' })
  t.same(a.json(), { run: 1, scope: 'acme' })
  t.same(b.json(), { run: 2, scope: 'globex' }, 'another tenant\'s same key is another operation')
  const aAgain = await post(app, '/scoped', 'same', {}, { 'x-tenant': 'acme' })
  t.equal(aAgain.headers['idempotent-replayed'], 'true', 'the same tenant replays')

  await post(app, '/global', 'g', {}, { 'x-tenant': 'acme' })
  const other = await post(app, '/global', 'g', {}, { 'x-tenant': 'globex' })
  t.equal(other.headers['idempotent-replayed'], 'true', 'on the global-scope route both tenants share one key space')
  t.same(runs, { scoped: 2, global: 1 })
})

// ---------------------------------------------------------------------------------------------
// The unscoped warning
// ---------------------------------------------------------------------------------------------

interface LogLine { level: number, msg: string }

async function loggedApp (t: Test, options: IdempotencyOptions): Promise<{ app: FastifyInstance, lines: LogLine[] }> {
  const lines: LogLine[] = []
  const stream = { write: (line: string) => { lines.push(JSON.parse(line) as LogLine) } }
  const app = Fastify({ logger: { level: 'warn', stream } })
  t.teardown(() => app.close())
  await app.register(idempotency, { store: memoryStore({ purgeInterval: 0 }), ...options })
  return { app, lines }
}

const UNSCOPED = /not scoped to a principal/

t.test('without a scope, a warning that keys are not scoped is logged exactly once, at startup', async (t) => {
  const { app, lines } = await loggedApp(t, {})
  const atRegistration = lines.filter((l) => UNSCOPED.test(l.msg)).length
  t.equal(atRegistration, 1, 'logged when the plugin is registered')
  app.post('/a', async () => ({}))
  app.post('/b', async () => ({}))
  app.patch('/c', async () => ({}))
  await app.ready()
  for (let i = 0; i < 3; i++) await app.inject({ method: 'POST', url: '/a', headers: keyed(`k${i}`), payload: {} })
  await app.inject({ method: 'POST', url: '/b', headers: keyed('k0'), payload: {} })
  const warnings = lines.filter((l) => UNSCOPED.test(l.msg))
  t.equal(warnings.length, 1, 'not repeated per route or per request')
  t.equal(warnings[0]?.level, 40, 'at warn level')
})

t.test('with a scope, no unscoped warning is logged', async (t) => {
  const { app, lines } = await loggedApp(t, { scope: () => 'tenant' })
  app.post('/a', async () => ({}))
  await app.ready()
  await app.inject({ method: 'POST', url: '/a', headers: keyed('k'), payload: {} })
  t.equal(lines.filter((l) => UNSCOPED.test(l.msg)).length, 0)
})
