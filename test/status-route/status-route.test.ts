import { randomBytes, randomUUID } from 'node:crypto'
import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest, type LightMyRequestResponse } from 'fastify'
import postgres from 'postgres'
import t, { type Test } from 'tap'
import idempotency, {
  memoryStore, type IdempotencyKeyStatus, type IdempotencyOptions, type IdempotencyStore
} from '../../lib/index.js'
import { postgresStore, type PostgresClient } from '../../drivers/postgres/index.js'
import { deferred, PROBLEM_TYPE } from '../helpers/app.js'

/*
 * `statusRoute` adds GET <url>/:key, where a caller asks about its own key. It
 * reads (store.get), never claims; it is scoped like claims, so another principal's key answers
 * exactly like an unknown one; it gets the app's own hooks (authentication) like any route declared
 * where the plugin is registered. Run against the memory store and PostgreSQL.
 */

const STATUS_URL = '/idempotency-keys/:key'
const CODE = 'FST_IDEMPOTENCY_INVALID_OPTION'
/** A recorded JSON body with a number beyond double precision: only a verbatim copy keeps it. */
const PAYMENT_JSON = '{"id":"pay_1","amount":12345678901234567890,"currency":"EUR"}'
const BINARY = Buffer.from([0x00, 0xff, 0x10, 0x80, 0x7f])

type StoreFactory = (t: Test) => Promise<IdempotencyStore>

interface Api {
  readonly app: FastifyInstance
  /** Handler executions, per route. */
  readonly runs: { payments: number, slow: number, files: number, big: number }
  /** Resolves once /slow's handler is running; `finish()` lets it answer. */
  readonly entered: Promise<void>
  readonly finish: () => void
  readonly post: (url: string, key: string, account?: string) => Promise<LightMyRequestResponse>
  readonly status: (key: string, account?: string) => Promise<LightMyRequestResponse>
}

/** An app whose scope is the `x-account` header, with the status route and four kinds of handler. */
async function api (t: Test, store: IdempotencyStore, options: IdempotencyOptions = {}): Promise<Api> {
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, {
    store,
    scope: (request) => String(request.headers['x-account']),
    statusRoute: STATUS_URL,
    ...options
  })
  const runs = { payments: 0, slow: 0, files: 0, big: 0 }
  const entered = deferred()
  const released = deferred()
  app.post('/payments', async (_request, reply) => {
    runs.payments++
    return reply.code(201).header('location', '/payments/pay_1').type('application/json').send(PAYMENT_JSON)
  })
  app.post('/slow', async (_request, reply) => {
    runs.slow++
    entered.resolve()
    await released.promise
    return reply.code(202).send({ done: true })
  })
  app.post('/files', async (_request, reply) => {
    runs.files++
    return reply.code(200).type('application/octet-stream').send(BINARY)
  })
  app.post('/big', { config: { idempotency: { maxResponseBytes: 4 } } }, async (_request, reply) => {
    runs.big++
    return reply.code(201).send({ large: 'x'.repeat(100) })
  })
  return {
    app,
    runs,
    entered: entered.promise,
    finish: () => released.resolve(),
    post: (url, key, account = 'acct_a') => app.inject({
      method: 'POST',
      url,
      headers: { 'idempotency-key': `"${key.replace(/["\\]/g, (c) => `\\${c}`)}"`, 'x-account': account, 'content-type': 'application/json' },
      payload: { amount: 100 }
    }),
    status: (key, account = 'acct_a') => app.inject({ method: 'GET', url: `/idempotency-keys/${encodeURIComponent(key)}`, headers: { 'x-account': account } })
  }
}

function json (res: LightMyRequestResponse): Record<string, unknown> {
  return JSON.parse(res.body) as Record<string, unknown>
}

function assertStatusAnswer (t: Test, res: LightMyRequestResponse): void {
  t.equal(res.statusCode, 200, 'answered 200')
  t.equal(res.headers['content-type'], 'application/json; charset=utf-8', 'as JSON')
  t.equal(res.headers['cache-control'], 'no-store', 'never cached')
}

/** Every header but Date, which only says when the answer was made. */
function headersOf (res: LightMyRequestResponse): Record<string, unknown> {
  const { date: _date, ...rest } = res.headers
  return rest
}

/** The behaviour every store must give the status route. */
function storeSuite (name: string, makeStore: StoreFactory): void {
  t.test(`${name}: a key in flight is in_progress; once answered, completed with its status`, async (t) => {
    const a = await api(t, await makeStore(t))
    const key = randomUUID()
    const original = a.post('/slow', key)
    await a.entered
    const during = await a.status(key)
    assertStatusAnswer(t, during)
    t.equal(during.body, '{"state":"in_progress"}')
    a.finish()
    t.equal((await original).statusCode, 202, 'the original answered')
    const after = await a.status(key)
    assertStatusAnswer(t, after)
    t.equal(after.body, '{"state":"completed","response":{"status":202}}', 'the recorded status only, without includeBody')
    t.equal(a.runs.slow, 1, 'asking never ran nor blocked the operation')
  })

  t.test(`${name}: without includeBody a completed key shows neither headers nor body`, async (t) => {
    const a = await api(t, await makeStore(t))
    const key = randomUUID()
    t.equal((await a.post('/payments', key)).statusCode, 201)
    const res = await a.status(key)
    assertStatusAnswer(t, res)
    t.same(json(res), { state: 'completed', response: { status: 201 } })
    t.notOk(res.body.includes('pay_1'), 'nothing of the recorded body or its Location')
    const head = await a.app.inject({ method: 'HEAD', url: `/idempotency-keys/${key}`, headers: { 'x-account': 'acct_a' } })
    t.equal(head.statusCode, 200, 'HEAD is answered too')
    t.equal(head.body, '', 'without a body')
  })

  t.test(`${name}: includeBody embeds a JSON body verbatim, with the replayable headers`, async (t) => {
    const a = await api(t, await makeStore(t), { statusRoute: { url: STATUS_URL, includeBody: true } })
    const key = randomUUID()
    const original = await a.post('/payments', key)
    t.equal(original.body, PAYMENT_JSON)
    const res = await a.status(key)
    assertStatusAnswer(t, res)
    t.same(json(res), {
      state: 'completed',
      response: {
        status: 201,
        headers: { 'content-type': 'application/json; charset=utf-8', location: '/payments/pay_1' },
        body: { encoding: 'json', value: JSON.parse(PAYMENT_JSON) }
      }
    })
    t.ok(res.body.endsWith(`"body":{"encoding":"json","value":${PAYMENT_JSON}}}}`),
      'the recorded bytes are embedded as they are (the 20-digit amount is intact)', { body: res.body })
    t.equal(a.runs.payments, 1)
  })

  t.test(`${name}: includeBody sends other bodies as base64, and null for a body that was not retained`, async (t) => {
    const a = await api(t, await makeStore(t), { statusRoute: { url: STATUS_URL, includeBody: true } })
    const fileKey = randomUUID()
    t.equal((await a.post('/files', fileKey)).rawPayload.compare(BINARY), 0, 'setup: the original sent the bytes')
    const file = JSON.parse((await a.status(fileKey)).body) as IdempotencyKeyStatus
    if (file.state !== 'completed') throw new Error(`expected a completed key, got ${file.state}`)
    t.equal(file.response.status, 200)
    t.same(file.response.headers, { 'content-type': 'application/octet-stream' })
    t.equal(file.response.body?.encoding, 'base64')
    t.equal(Buffer.from(String(file.response.body?.value), 'base64').compare(BINARY), 0, 'the base64 decodes to the recorded bytes')

    const bigKey = randomUUID()
    t.equal((await a.post('/big', bigKey)).statusCode, 201)
    const big = await a.status(bigKey)
    assertStatusAnswer(t, big)
    t.same(json(big), { state: 'completed', response: { status: 201, headers: { 'content-type': 'application/json; charset=utf-8' }, body: null } })
    t.equal(a.runs.big, 1)
  })

  t.test(`${name}: an unknown key is a 404 key-unknown problem`, async (t) => {
    const a = await api(t, await makeStore(t))
    const res = await a.status(`never-${randomUUID()}`)
    t.equal(res.statusCode, 404)
    t.match(res.headers['content-type'], /^application\/problem\+json(; charset=utf-8)?$/)
    t.equal(res.headers['cache-control'], 'no-store')
    t.same(json(res), {
      type: PROBLEM_TYPE('key-unknown'),
      title: 'Idempotency-Key is unknown',
      status: 404,
      detail: 'No request with this Idempotency-Key is recorded for you: it was never used, or its record expired.'
    })
  })

  t.test(`${name}: another principal's key answers byte for byte like an unknown key`, async (t) => {
    const a = await api(t, await makeStore(t), { statusRoute: { url: STATUS_URL, includeBody: true } })
    const completed = randomUUID()
    const inFlight = randomUUID()
    t.equal((await a.post('/payments', completed, 'acct_owner')).statusCode, 201)
    const original = a.post('/slow', inFlight, 'acct_owner')
    await a.entered
    t.equal((await a.status(completed, 'acct_owner')).statusCode, 200, 'setup: the owner sees its completed key')
    t.equal((await a.status(inFlight, 'acct_owner')).statusCode, 200, 'setup: the owner sees its key in flight')

    // Same length as the others, so not even Content-Length can differ.
    const unknown = await a.status(randomUUID(), 'acct_other')
    for (const [what, key] of [['completed', completed], ['in flight', inFlight]] as const) {
      const foreign = await a.status(key, 'acct_other')
      t.equal(foreign.statusCode, unknown.statusCode, `${what}: same status`)
      t.equal(foreign.body, unknown.body, `${what}: same body`)
      t.same(headersOf(foreign), headersOf(unknown), `${what}: same headers`)
    }
    a.finish()
    await original
    t.equal(a.runs.payments + a.runs.slow, 2, 'each operation ran once')
  })

  t.test(`${name}: a store that fails or hangs answers 503 store-unavailable`, async (t) => {
    const inner = await makeStore(t)
    let gets = 0
    const failing: IdempotencyStore = {
      ...bound(inner),
      get: async () => { gets++; throw new Error('connection refused /srv/db.sock') }
    }
    const a = await api(t, failing, { retryAfter: 3 })
    const res = await a.status('any-key')
    t.equal(res.statusCode, 503)
    t.match(res.headers['content-type'], /^application\/problem\+json(; charset=utf-8)?$/)
    t.equal(res.headers['retry-after'], '3')
    t.equal(json(res).type, PROBLEM_TYPE('store-unavailable'))
    t.notOk(res.body.includes('db.sock'), 'the store error is not exposed')
    t.equal(gets, 1)

    const hanging: IdempotencyStore = { ...bound(inner), get: () => new Promise(() => {}) }
    const b = await api(t, hanging, { storeTimeout: 50, onStoreError: 'bypass' })
    const late = await b.status('any-key')
    t.equal(late.statusCode, 503, 'after storeTimeout, even with onStoreError: bypass (there is nothing to run)')
  })

  t.test(`${name}: asking never claims: the key stays free, and a key in flight is not taken over`, async (t) => {
    const store = await makeStore(t)
    // GET protected too, and the lookup sends a key: the status route must still only read.
    const a = await api(t, store, { methods: ['POST', 'GET'] })
    const key = randomUUID()
    const res = await a.app.inject({
      method: 'GET', url: `/idempotency-keys/${key}`, headers: { 'x-account': 'acct_a', 'idempotency-key': `"${key}"` }
    })
    t.equal(res.statusCode, 404)
    t.equal(await store.get({ scope: 'acct_a', key }), null, 'nothing was recorded for the key looked up')
    const first = await a.post('/payments', key)
    t.equal(first.statusCode, 201)
    t.equal(first.headers['idempotent-replayed'], undefined, 'the first POST executes')

    const slow = randomUUID()
    const original = a.post('/slow', slow)
    await a.entered
    for (let i = 0; i < 3; i++) t.equal(json(await a.status(slow)).state, 'in_progress', `lookup ${i + 1}: in progress`)
    a.finish()
    t.equal((await original).statusCode, 202)
    // Had a lookup claimed or taken the key over, the original's fenced completion would have failed.
    t.same(json(await a.status(slow)), { state: 'completed', response: { status: 202 } }, 'the original still recorded its outcome')
    t.equal(a.runs.slow, 1)
  })

  t.test(`${name}: the key is the percent-decoded path segment, checked like a claimed key`, async (t) => {
    const a = await api(t, await makeStore(t), { maxKeyLength: 20 })
    const odd = 'a/b c"d%e,f?g#h\\i'
    t.equal((await a.post('/payments', odd)).statusCode, 201, 'setup: a key with reserved characters, sent as an sf-string')
    const found = await a.status(odd)
    t.equal(found.statusCode, 200, `found at /idempotency-keys/${encodeURIComponent(odd)}`)
    t.equal(json(found).state, 'completed')

    for (const [what, path, detail] of [
      ['longer than maxKeyLength', 'k'.repeat(21), 'at most 20 characters'],
      ['not ASCII', encodeURIComponent('clé'), 'printable ASCII'],
      ['a control character', '%0A', 'printable ASCII'],
      ['empty', '', 'must not be empty']
    ] as const) {
      const res = await a.app.inject({ method: 'GET', url: `/idempotency-keys/${path}`, headers: { 'x-account': 'acct_a' } })
      t.equal(res.statusCode, 400, `${what}: 400`)
      t.equal(json(res).type, PROBLEM_TYPE('key-invalid'), `${what}: key-invalid`)
      t.match(String(json(res).detail), detail, `${what}: says why`)
    }
  })
}

/** A store's methods as own properties bound to it, so a test can replace one with a spread. */
function bound (store: IdempotencyStore): IdempotencyStore {
  return {
    claim: (request) => store.claim(request),
    complete: (lease, response, ttl) => store.complete(lease, response, ttl),
    release: (lease) => store.release(lease),
    renew: (lease, ms) => store.renew(lease, ms),
    get: (id) => store.get(id),
    purgeExpired: (limit) => store.purgeExpired(limit),
    close: () => store.close()
  }
}

storeSuite('memory', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  return store
})

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/status-route/status-route.test.ts`, which starts a throwaway PostgreSQL.')
} else {
  const sql: PostgresClient = postgres(DATABASE_URL, { max: 4, onnotice: () => {} })
  const schema = `idem_status_${randomBytes(4).toString('hex')}`
  t.teardown(async () => {
    await sql`DROP SCHEMA IF EXISTS ${sql(schema)} CASCADE`
    await sql.end({ timeout: 1 })
  })
  storeSuite('postgres', async (t) => {
    const store = postgresStore({ sql, schema, table: 'records', purgeInterval: 0 })
    await store.migrate()
    t.teardown(() => store.close())
    return store
  })
}

t.test('a hook the app adds right after registering runs for the status route (auth)', async (t) => {
  for (const hook of ['onRequest', 'preHandler'] as const) {
    const inner = memoryStore({ purgeInterval: 0 })
    t.teardown(() => inner.close())
    let gets = 0
    const store: IdempotencyStore = { ...bound(inner), get: (id) => { gets++; return inner.get(id) } }
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: (request) => String(request.headers['x-account']), statusRoute: STATUS_URL })
    app.addHook(hook, async (request: FastifyRequest, reply: FastifyReply) => {
      if (request.headers.authorization !== 'Bearer ok') return reply.code(401).send({ error: 'unauthenticated' })
    })
    const refused = await app.inject({ method: 'GET', url: '/idempotency-keys/k1', headers: { 'x-account': 'acct_a' } })
    t.equal(refused.statusCode, 401, `${hook}: refused without credentials`)
    t.same(refused.json(), { error: 'unauthenticated' }, `${hook}: the app's own answer`)
    t.equal(gets, 0, `${hook}: the store was not asked`)
    const allowed = await app.inject({ method: 'GET', url: '/idempotency-keys/k1', headers: { 'x-account': 'acct_a', authorization: 'Bearer ok' } })
    t.equal(allowed.statusCode, 404, `${hook}: authenticated, the lookup runs`)
    t.equal(gets, 1)
  }
})

t.test('the status route lives under the prefix of the context the plugin is registered in', async (t) => {
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(async (v1) => {
    await v1.register(idempotency, { store: memoryStore({ purgeInterval: 0 }), scope: () => 'test', statusRoute: STATUS_URL })
  }, { prefix: '/v1' })
  const inside = await app.inject({ method: 'GET', url: '/v1/idempotency-keys/k1' })
  t.equal(inside.statusCode, 404)
  t.equal(inside.json().type, PROBLEM_TYPE('key-unknown'), 'the status route answers under /v1')
  const outside = await app.inject({ method: 'GET', url: '/idempotency-keys/k1' })
  t.equal(outside.statusCode, 404)
  t.match(outside.json(), { error: 'Not Found', message: /^Route GET:\/idempotency-keys\/k1 not found$/ }, 'no route outside the prefix')
})

t.test('without statusRoute there is no status route', async (t) => {
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store: memoryStore({ purgeInterval: 0 }), scope: () => 'test' })
  await app.ready()
  t.equal(app.hasRoute({ method: 'GET', url: STATUS_URL }), false)
})

t.test('statusRoute is validated at registration', async (t) => {
  const bad: ReadonlyArray<readonly [string, unknown, string]> = [
    ['a path without :key', '/idempotency-keys', 'option "statusRoute"'],
    ['a relative path', 'idempotency-keys/:key', 'option "statusRoute"'],
    ['a path with a query', '/keys/:key?x=1', 'option "statusRoute"'],
    [':key inside a segment', '/keys/k:key', 'option "statusRoute"'],
    ['a number', 42, 'option "statusRoute"'],
    ['null', null, 'option "statusRoute"'],
    ['an object without url', { includeBody: true }, 'option "statusRoute.url"'],
    ['an unknown member', { url: STATUS_URL, body: true }, 'option "statusRoute.body"'],
    ['includeBody not a boolean', { url: STATUS_URL, includeBody: 'yes' }, 'option "statusRoute.includeBody"']
  ]
  for (const [what, value, option] of bad) {
    const app = Fastify()
    t.teardown(() => app.close())
    const err = await app.register(idempotency, { statusRoute: value as string }).then(() => null, (e: unknown) => e)
    t.match(err, { name: 'InvalidOptionError', code: CODE, option }, `${what}: refused, naming ${option}`)
  }

  const taken = Fastify()
  t.teardown(() => taken.close())
  taken.get(STATUS_URL, async () => 'mine')
  await t.rejects(async () => { await taken.register(idempotency, { statusRoute: STATUS_URL }) }, { code: 'FST_ERR_DUPLICATED_ROUTE' },
    'a path the app already uses is refused at boot')

  const routeConfig = Fastify()
  t.teardown(() => routeConfig.close())
  await routeConfig.register(idempotency, { scope: () => 'test' })
  t.throws(() => routeConfig.post('/x', { config: { idempotency: { statusRoute: STATUS_URL } as never } }, async () => ({})),
    { code: CODE, option: 'route POST /x config.idempotency.statusRoute' }, 'a registration option, not a route one')
})
