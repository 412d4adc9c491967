import type { FastifyInstance, InjectOptions } from 'fastify'
import t, { type Test } from 'tap'
import {
  CANONICAL, CUSTOM, canonicalFingerprint, canonicalJson, customFingerprint, fingerprintsEqual
} from '../../lib/core/fingerprint.js'
import { memoryStore, type IdempotencyOptions } from '../../lib/index.js'
import type { StoredRecord } from '../../lib/core/store.js'
import { buildApp, deferred, keyed, PROBLEM_TYPE } from '../helpers/app.js'

/*
 * Behaviour 5 of the contract: the same key with a different request (method, target, body) is a
 * 422, whether the original completed or is still in flight; canonical mode ignores JSON key order
 * and whitespace, raw mode does not. First the pure functions of lib/core/fingerprint.ts, then HTTP.
 */

const SCOPE = 'test'

// ---------------------------------------------------------------------------------------------
// canonicalJson

t.test('canonicalJson sorts object keys at every depth', async (t) => {
  t.equal(canonicalJson({ b: 1, a: { d: 1, c: { f: 1, e: 2 } } }), '{"a":{"c":{"e":2,"f":1},"d":1},"b":1}')
  t.equal(canonicalJson({ z: 1, a: 2 }), canonicalJson({ a: 2, z: 1 }), 'insertion order does not matter')
  t.equal(canonicalJson({ B: 1, a: 2, _: 3, 10: 4, 9: 5 }), '{"10":4,"9":5,"B":1,"_":3,"a":2}', 'sorted by code unit, not numerically or case-insensitively')
})

t.test('canonicalJson keeps array order', async (t) => {
  t.equal(canonicalJson([3, 1, 2]), '[3,1,2]')
  t.not(canonicalJson([1, 2]), canonicalJson([2, 1]), 'arrays in another order are another request')
  t.equal(canonicalJson([]), '[]')
  t.equal(canonicalJson({}), '{}')
})

t.test('canonicalJson writes numbers the ECMAScript way: 1.0 is 1, 1e2 is 100', async (t) => {
  const parsed = JSON.parse('{"a":1.0,"b":1e2,"c":-0.50,"d":1E-7,"e":12345678901234567890}') as unknown
  t.equal(canonicalJson(parsed), '{"a":1,"b":100,"c":-0.5,"d":1e-7,"e":12345678901234567000}')
  t.equal(canonicalJson(JSON.parse('1.0')), '1')
  t.equal(canonicalJson(JSON.parse('1e2')), '100')
  t.equal(canonicalJson(JSON.parse('{"n":1.0}')), canonicalJson(JSON.parse('{"n":1}')), '1.0 and 1 are one request')
  t.not(canonicalJson({ n: 1 }), canonicalJson({ n: '1' }), 'the number 1 and the string "1" are not')
})

t.test('canonicalJson keeps unicode strings and sorts keys by UTF-16 code units', async (t) => {
  t.equal(canonicalJson({ name: 'café ☕ 😀' }), '{"name":"café ☕ 😀"}', 'non-ASCII is not escaped')
  t.equal(canonicalJson({ s: 'quote " backslash \\ newline \n tab \t nul \u0000' }),
    '{"s":"quote \\" backslash \\\\ newline \\n tab \\t nul \\u0000"}', 'JSON string escaping')
  t.equal(canonicalJson({ é: 1, e: 2, 日本: 3 }), '{"e":2,"é":1,"日本":3}')
  // U+FFFD sorts after U+1F600 by code point, but before it by UTF-16 code unit (0xFFFD > 0xD83D).
  t.equal(canonicalJson({ '\uFFFD': 1, '😀': 2 }), '{"😀":2,"\uFFFD":1}', 'RFC 8785 order (UTF-16 code units)')
  t.not(canonicalJson({ s: 'e\u0301' }), canonicalJson({ s: 'é' }), 'no unicode normalisation: other bytes, other request')
})

t.test('canonicalJson handles nested arrays of objects', async (t) => {
  const a = { items: [{ sku: 'x', qty: 1 }, { qty: 2, sku: 'y', tags: [{ b: 1, a: 0 }] }], total: 3 }
  const b = { total: 3, items: [{ qty: 1, sku: 'x' }, { tags: [{ a: 0, b: 1 }], sku: 'y', qty: 2 }] }
  t.equal(canonicalJson(a), '{"items":[{"qty":1,"sku":"x"},{"qty":2,"sku":"y","tags":[{"a":0,"b":1}]}],"total":3}')
  t.equal(canonicalJson(a), canonicalJson(b))
  t.equal(canonicalJson([[{ b: 1, a: 2 }], [[]]]), '[[{"a":2,"b":1}],[[]]]')
})

t.test('canonicalJson honours toJSON, skips undefined members and encodes Buffers', async (t) => {
  t.equal(canonicalJson(new Date(0)), '"1970-01-01T00:00:00.000Z"')
  t.equal(canonicalJson({ when: new Date(0) }), '{"when":"1970-01-01T00:00:00.000Z"}')
  t.equal(canonicalJson({ toJSON: () => ({ b: 1, a: 2 }) }), '{"a":2,"b":1}', 'the toJSON result is canonicalised too')
  t.equal(canonicalJson({ a: undefined, b: 1 }), '{"b":1}', 'an undefined member is absent, as in JSON.stringify')
  t.equal(canonicalJson([undefined, 1]), '[null,1]', 'an undefined array item is null, as in JSON.stringify')
  t.equal(canonicalJson(null), 'null')
  t.equal(canonicalJson(true), 'true')
  t.equal(canonicalJson('text'), '"text"')
  t.equal(canonicalJson({ bin: Buffer.from([0, 1, 2]) }), '{"bin":"AAEC"}')
})

t.test('canonicalJson of a parsed JSON text is the same for any key order and whitespace', async (t) => {
  const texts = ['{"a":1,"b":[1,{"y":2,"x":1}]}', '{ "b" : [ 1 , { "x" : 1 , "y" : 2 } ] ,\n\t"a" : 1.0 }']
  t.equal(canonicalJson(JSON.parse(texts[0] as string)), canonicalJson(JSON.parse(texts[1] as string)))
})

// ---------------------------------------------------------------------------------------------
// canonicalFingerprint, customFingerprint, fingerprintsEqual

t.test('canonicalFingerprint is a versioned SHA-256 and is deterministic', async (t) => {
  const a = canonicalFingerprint('POST', '/pay', { a: 1, b: 2 })
  const b = canonicalFingerprint('POST', '/pay', { b: 2, a: 1 })
  t.equal(a.algorithm, CANONICAL)
  t.equal(CANONICAL, 'canonical-v1')
  t.ok(Buffer.isBuffer(a.digest))
  t.equal(a.digest.length, 32)
  t.ok(fingerprintsEqual(a, b), 'key order does not matter')
})

t.test('canonicalFingerprint distinguishes the method', async (t) => {
  t.notOk(fingerprintsEqual(canonicalFingerprint('POST', '/pay', { a: 1 }), canonicalFingerprint('PUT', '/pay', { a: 1 })))
  t.notOk(fingerprintsEqual(canonicalFingerprint('POST', '/pay', { a: 1 }), canonicalFingerprint('PATCH', '/pay', { a: 1 })))
})

t.test('canonicalFingerprint distinguishes the target: path and query', async (t) => {
  const base = canonicalFingerprint('POST', '/pay', { a: 1 })
  t.notOk(fingerprintsEqual(base, canonicalFingerprint('POST', '/refund', { a: 1 })), 'path')
  t.notOk(fingerprintsEqual(base, canonicalFingerprint('POST', '/pay?x=1', { a: 1 })), 'a query')
  t.notOk(fingerprintsEqual(canonicalFingerprint('POST', '/pay?x=1', { a: 1 }), canonicalFingerprint('POST', '/pay?x=2', { a: 1 })), 'another query')
  // The method, target and body are separated, so moving characters across a boundary changes the digest.
  t.notOk(fingerprintsEqual(canonicalFingerprint('POST', '/a', 'b'), canonicalFingerprint('POST', '/ab', '')), 'target/body boundary')
})

t.test('canonicalFingerprint distinguishes the body and its kind: text, JSON value, bytes, none, null', async (t) => {
  const fp = (body: unknown) => canonicalFingerprint('POST', '/pay', body)
  t.notOk(fingerprintsEqual(fp({ a: 1 }), fp({ a: 2 })), 'another value')
  t.notOk(fingerprintsEqual(fp('{}'), fp({})), "a text body '{}' is not the object {}")
  t.notOk(fingerprintsEqual(fp(Buffer.from('{}')), fp({})), 'a Buffer is not the object {}')
  t.notOk(fingerprintsEqual(fp(Buffer.from('{}')), fp('{}')), 'a Buffer is not the text')
  t.notOk(fingerprintsEqual(fp(undefined), fp(null)), 'no body is not a JSON null')
  t.notOk(fingerprintsEqual(fp(undefined), fp('')), 'no body is not an empty text')
  t.notOk(fingerprintsEqual(fp(undefined), fp(Buffer.alloc(0))), 'no body is not empty bytes')
  t.notOk(fingerprintsEqual(fp(''), fp(Buffer.alloc(0))), 'an empty text is not empty bytes')
  t.notOk(fingerprintsEqual(fp(undefined), fp('none')), "no body is not the text 'none'")
  t.notOk(fingerprintsEqual(fp([]), fp({})), '[] is not {}')
  t.ok(fingerprintsEqual(fp(Buffer.from('abc')), fp(Buffer.from('abc'))), 'equal bytes are equal')
})

t.test('fingerprints of different algorithms never compare equal, even with equal digests', async (t) => {
  const canonical = canonicalFingerprint('POST', '/pay', { a: 1 })
  t.notOk(fingerprintsEqual(canonical, { algorithm: 'raw-v1', digest: canonical.digest }))
  t.notOk(fingerprintsEqual(canonical, { algorithm: 'canonical-v2', digest: canonical.digest }))
  const custom = customFingerprint('100')
  t.equal(custom.algorithm, CUSTOM)
  t.equal(CUSTOM, 'custom-v1')
  t.ok(fingerprintsEqual(custom, customFingerprint(Buffer.from('100'))), 'a string and its UTF-8 bytes are one custom fingerprint')
  t.notOk(fingerprintsEqual(custom, customFingerprint('101')))
})

// ---------------------------------------------------------------------------------------------
// Over HTTP

async function setup (t: Test, plugin: IdempotencyOptions = {}) {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store, ...plugin } })
  return { app, store }
}

/** A POST /pay route that answers 201 with a fresh charge id on every run. */
function payRoute (app: FastifyInstance, url = '/pay'): { runs: () => number } {
  let runs = 0
  app.post(url, async (_request, reply) => {
    runs++
    return reply.code(201).send({ id: `ch_${runs}` })
  })
  return { runs: () => runs }
}

function post (key: string, payload: string | object, url = '/pay', extra: Record<string, string> = {}): InjectOptions {
  return { method: 'POST', url, headers: keyed(key, extra), payload }
}

function isKeyReused (t: Test, res: { statusCode: number, headers: Record<string, unknown>, json: () => unknown }, message: string): void {
  t.equal(res.statusCode, 422, `${message}: 422`)
  t.match(res.headers['content-type'], /^application\/problem\+json/, `${message}: a problem`)
  t.match(res.json(), { type: PROBLEM_TYPE('key-reused'), status: 422 }, `${message}: key-reused`)
  t.equal(res.headers['idempotent-replayed'], undefined, `${message}: not a replay`)
}

function completed (t: Test, record: StoredRecord | null): Extract<StoredRecord, { state: 'completed' }> {
  if (record === null || record.state !== 'completed') {
    t.fail(`expected a completed record, got ${record === null ? 'null' : record.state}`)
    throw new Error('no completed record')
  }
  return record
}

t.test('canonical mode: the same JSON with other key order and whitespace is the same request (replay)', async (t) => {
  const { app } = await setup(t)
  const route = payRoute(app)
  const first = await app.inject(post('canon-1', '{"a":1,"b":2}'))
  const second = await app.inject(post('canon-1', '{ "b": 2,\n  "a": 1.0 }'))
  t.equal(first.statusCode, 201)
  t.equal(second.statusCode, 201)
  t.equal(second.headers['idempotent-replayed'], 'true')
  t.equal(second.body, first.body)
  t.equal(route.runs(), 1)
})

t.test('raw mode: other key order or whitespace is a different request (422); identical bytes replay', async (t) => {
  const { app, store } = await setup(t, { fingerprint: 'raw' })
  const route = payRoute(app)
  const first = await app.inject(post('raw-1', '{"a":1,"b":2}'))
  t.equal(first.statusCode, 201)
  isKeyReused(t, await app.inject(post('raw-1', '{"b":2,"a":1}')), 'other key order')
  isKeyReused(t, await app.inject(post('raw-1', '{"a": 1, "b": 2}')), 'other whitespace')
  const same = await app.inject(post('raw-1', '{"a":1,"b":2}'))
  t.equal(same.statusCode, 201)
  t.equal(same.headers['idempotent-replayed'], 'true', 'identical bytes replay')
  t.equal(route.runs(), 1)
  t.equal(completed(t, await store.get({ scope: SCOPE, key: 'raw-1' })).fingerprint.algorithm, 'raw-v1', 'the algorithm is stored with the record')
})

t.test('canonical mode stores its algorithm with the record', async (t) => {
  const { app, store } = await setup(t)
  payRoute(app)
  await app.inject(post('algo-1', { a: 1 }))
  const record = completed(t, await store.get({ scope: SCOPE, key: 'algo-1' }))
  t.equal(record.fingerprint.algorithm, 'canonical-v1')
  t.ok(record.fingerprint.digest.equals(canonicalFingerprint('POST', '/pay', { a: 1 }).digest))
})

t.test('same key with a different body: 422 problem, handler not run, and again 422 on a second try', async (t) => {
  const { app } = await setup(t)
  const route = payRoute(app)
  t.equal((await app.inject(post('diff-1', { amount: 100 }))).statusCode, 201)
  isKeyReused(t, await app.inject(post('diff-1', { amount: 999 })), 'first mismatch')
  isKeyReused(t, await app.inject(post('diff-1', { amount: 999 })), 'second mismatch')
  t.equal(route.runs(), 1, 'the handler never ran for the mismatches')
})

t.test('a 422 never poisons the record: the original request still replays its original 201', async (t) => {
  const { app, store } = await setup(t)
  const route = payRoute(app)
  const first = await app.inject(post('poison-1', { amount: 100 }))
  const before = completed(t, await store.get({ scope: SCOPE, key: 'poison-1' }))

  isKeyReused(t, await app.inject(post('poison-1', { amount: 5 })), 'mismatch')
  const after = completed(t, await store.get({ scope: SCOPE, key: 'poison-1' }))
  t.equal(after.response.statusCode, 201, 'the record still holds the 201')
  t.ok(after.response.body?.equals(before.response.body as Buffer), 'and its body')
  t.ok(fingerprintsEqual(after.fingerprint, before.fingerprint), 'and the original fingerprint')

  const replay = await app.inject(post('poison-1', { amount: 100 }))
  t.equal(replay.statusCode, 201)
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.ok(replay.rawPayload.equals(first.rawPayload))
  t.equal(route.runs(), 1)
})

t.test('a different query string under the same key is a different request (422)', async (t) => {
  const { app } = await setup(t)
  const route = payRoute(app)
  t.equal((await app.inject(post('query-1', { a: 1 }, '/pay?x=1'))).statusCode, 201)
  isKeyReused(t, await app.inject(post('query-1', { a: 1 }, '/pay?x=2')), 'other query')
  isKeyReused(t, await app.inject(post('query-1', { a: 1 }, '/pay')), 'no query')
  t.equal((await app.inject(post('query-1', { a: 1 }, '/pay?x=1'))).headers['idempotent-replayed'], 'true')
  t.equal(route.runs(), 1)
})

t.test('a different method on the same path under the same key is a different request (422)', async (t) => {
  const { app } = await setup(t)
  let runs = 0
  const handler = async (): Promise<{ runs: number }> => ({ runs: ++runs })
  app.post('/pay', handler)
  app.put('/pay', { config: { idempotency: true } }, handler)
  t.equal((await app.inject(post('method-1', { a: 1 }))).statusCode, 200)
  isKeyReused(t, await app.inject({ method: 'PUT', url: '/pay', headers: keyed('method-1'), payload: { a: 1 } }), 'PUT after POST')
  t.equal(runs, 1)
})

t.test('the key namespace is per scope, not per route: the same key on another route is a 422', async (t) => {
  // The target is part of the fingerprint, so a key used on /orders cannot be used on /refunds by
  // the same principal: the second route gets 422 instead of running or replaying /orders.
  const { app } = await setup(t)
  const orders = payRoute(app, '/orders')
  const refunds = payRoute(app, '/refunds')
  t.equal((await app.inject(post('route-1', { amount: 1 }, '/orders'))).statusCode, 201)
  isKeyReused(t, await app.inject(post('route-1', { amount: 1 }, '/refunds')), 'other route')
  t.equal(orders.runs(), 1)
  t.equal(refunds.runs(), 0, 'the other route never ran')
})

t.test('while the original is in flight: a different body gets 422 and a same-body duplicate gets 409', async (t) => {
  const { app, store } = await setup(t)
  const entered = deferred()
  const gate = deferred()
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    runs++
    entered.resolve()
    await gate.promise
    return reply.code(201).send({ id: `ch_${runs}` })
  })

  const original = app.inject(post('flight-1', { amount: 100 }))
  await entered.promise
  t.equal((await store.get({ scope: SCOPE, key: 'flight-1' }))?.state, 'in_progress')

  const [mismatch, duplicate] = await Promise.all([
    app.inject(post('flight-1', { amount: 5 })),
    app.inject(post('flight-1', { amount: 100 }))
  ])
  isKeyReused(t, mismatch, 'in-flight mismatch')
  t.equal(duplicate.statusCode, 409, 'same body in flight: 409')
  t.match(duplicate.json(), { type: PROBLEM_TYPE('request-in-progress'), status: 409 })
  t.ok(duplicate.headers['retry-after'], 'with Retry-After')

  gate.resolve()
  const done = await original
  t.equal(done.statusCode, 201)
  const replay = await app.inject(post('flight-1', { amount: 100 }))
  t.equal(replay.headers['idempotent-replayed'], 'true', 'the original completes and replays normally')
  isKeyReused(t, await app.inject(post('flight-1', { amount: 5 })), 'mismatch after completion')
  t.equal(runs, 1)
})

t.test('a custom fingerprint function decides alone what is the same request (custom-v1)', async (t) => {
  const { app, store } = await setup(t, {
    fingerprint: (request) => String((request.body as { amount: number }).amount)
  })
  const route = payRoute(app)
  t.equal((await app.inject(post('custom-1', { amount: 100, note: 'first' }))).statusCode, 201)

  const otherNote = await app.inject(post('custom-1', { amount: 100, note: 'second' }))
  t.equal(otherNote.statusCode, 201)
  t.equal(otherNote.headers['idempotent-replayed'], 'true', 'a field outside the fingerprint does not matter')
  isKeyReused(t, await app.inject(post('custom-1', { amount: 101, note: 'first' })), 'other amount')
  t.equal(route.runs(), 1)

  const record = completed(t, await store.get({ scope: SCOPE, key: 'custom-1' }))
  t.equal(record.fingerprint.algorithm, 'custom-v1')
  t.ok(record.fingerprint.digest.equals(customFingerprint('100').digest), 'SHA-256 of what the function returned')
})

t.test('a custom fingerprint set on one route applies to that route only', async (t) => {
  const { app } = await setup(t)
  let runs = 0
  app.post('/pay', { config: { idempotency: { fingerprint: (request) => String((request.body as { amount: number }).amount) } } },
    async () => ({ runs: ++runs }))
  app.post('/other', async () => ({ runs: ++runs }))
  await app.inject(post('route-custom-1', { amount: 1, note: 'a' }))
  t.equal((await app.inject(post('route-custom-1', { amount: 1, note: 'b' }))).headers['idempotent-replayed'], 'true')
  await app.inject(post('route-custom-2', { amount: 1, note: 'a' }, '/other'))
  isKeyReused(t, await app.inject(post('route-custom-2', { amount: 1, note: 'b' }, '/other')), 'canonical elsewhere')
  t.equal(runs, 2)
})

t.test('form-urlencoded bodies are fingerprinted canonically', async (t) => {
  const { app } = await setup(t)
  app.addContentTypeParser('application/x-www-form-urlencoded', { parseAs: 'string' },
    (_request, body, done) => done(null, Object.fromEntries(new URLSearchParams(body as string))))
  const route = payRoute(app)
  const form = { 'content-type': 'application/x-www-form-urlencoded' }

  const first = await app.inject(post('form-1', 'a=1&b=2', '/pay', form))
  t.equal(first.statusCode, 201)
  const reordered = await app.inject(post('form-1', 'b=2&a=1', '/pay', form))
  t.equal(reordered.statusCode, 201)
  t.equal(reordered.headers['idempotent-replayed'], 'true', 'b=2&a=1 is the same form')
  t.equal(reordered.body, first.body)
  isKeyReused(t, await app.inject(post('form-1', 'a=1&b=3', '/pay', form)), 'another value')
  t.equal(route.runs(), 1)
})
