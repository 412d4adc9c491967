import assert from 'node:assert/strict'
import { parse as parseForm } from 'node:querystring'
import fc from 'fast-check'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import { canonicalJson } from '../../lib/core/fingerprint.js'
import idempotency, { memoryStore, type IdempotencyOptions } from '../../lib/index.js'
import { jsonEqual, jsonObject, jsonValue, mutate, reformat } from './json-arbitraries.js'
import { assertProblem, counted, errorLog, fcParams, type CountedStore } from './support.js'

/*
 * What README "Fingerprints" documents for canonical-v1: the parsed body in a canonical JSON form
 * close to RFC 8785 (members sorted, ECMAScript number formatting), so writing the same JSON value
 * differently (member order, whitespace, number notation, string escapes) is the same request, and
 * any change of meaning is a different one: 422 for a reused key (draft §2.7). raw-v1: any byte of
 * difference is a different request.
 */

// ---------------------------------------------------------------------------------------------
// canonicalJson, without HTTP

t.test('canonicalJson: any JSON text of the same value has the same canonical form', async (t) => {
  let rewritten = 0
  fc.assert(fc.property(jsonValue, fc.gen(), (value, g) => {
    const text = reformat(value, g)
    assert.equal(canonicalJson(JSON.parse(text)), canonicalJson(value), `${JSON.stringify(text)} is ${JSON.stringify(value)}`)
    if (text !== JSON.stringify(value)) rewritten++
  }), fcParams(0x8785, 800))
  t.ok(rewritten > 500, `the texts really differed from JSON.stringify's (${rewritten})`)
})

t.test('canonicalJson: a value that means something else has another canonical form', async (t) => {
  let inside = 0
  fc.assert(fc.property(jsonValue, fc.gen(), (value, g) => {
    const changed = mutate(value, g)
    assert.ok(!jsonEqual(changed, value), 'the generator changed the meaning')
    assert.notEqual(canonicalJson(JSON.parse(JSON.stringify(changed))), canonicalJson(value),
      `${JSON.stringify(changed)} differs from ${JSON.stringify(value)}`)
    if (typeof changed === typeof value && Array.isArray(changed) === Array.isArray(value)) inside++
  }), fcParams(0x422, 3000))
  // Many changes must be deep inside the value, where a sloppy canonical form would miss them.
  t.ok(inside > 1000, `many changes were inside the value, not of its outer type (${inside})`)
})

// ---------------------------------------------------------------------------------------------
// Through HTTP: replay for the same value, 422 for another

interface FingerprintApp {
  readonly app: FastifyInstance
  readonly store: CountedStore
  /** Executions per key. */
  readonly runs: Map<string, number>
  readonly errors: string[]
}

async function fingerprintApp (t: Test, options: IdempotencyOptions = {}): Promise<FingerprintApp> {
  const log = errorLog()
  const app = Fastify({ logger: log.logger })
  const store = counted(memoryStore({ purgeInterval: 0 }))
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: () => 'test', ...options })
  const runs = new Map<string, number>()
  app.post('/orders', async (request, reply) => {
    const key = request.idempotency?.key ?? ''
    runs.set(key, (runs.get(key) ?? 0) + 1)
    return reply.code(201).send({ key, execution: runs.get(key), received: request.body })
  })
  return { app, store, runs, errors: log.lines }
}

function send (app: FastifyInstance, key: string, body: string, url = '/orders'): Promise<LightMyRequestResponse> {
  return app.inject({ method: 'POST', url, headers: { 'idempotency-key': `"${key}"`, 'content-type': 'application/json' }, payload: body })
}

t.test('canonical: the same value written differently replays; a changed value is 422 and leaves the record intact', async (t) => {
  const h = await fingerprintApp(t)
  let n = 0
  let byteDifferent = 0
  await fc.assert(fc.asyncProperty(jsonObject, fc.gen(), async (value, g) => {
    const key = `canonical-${n++}`
    const original = JSON.stringify(value)
    const same = reformat(value, g)
    const changed = JSON.stringify(mutate(value, g))
    if (same !== original) byteDifferent++

    const first = await send(h.app, key, original)
    assert.equal(first.statusCode, 201, `first: ${first.body}`)
    const retry = await send(h.app, key, same)
    assert.equal(retry.statusCode, 201, `${JSON.stringify(same)} replays ${original}: ${retry.body}`)
    assert.equal(retry.headers['idempotent-replayed'], 'true', `${JSON.stringify(same)} is a replay of ${original}`)
    assert.equal(retry.body, first.body, 'the recorded body, byte for byte')

    assertProblem(await send(h.app, key, changed), 'key-reused', 422, `${changed} vs ${original}`)
    const after = await send(h.app, key, same)
    assert.equal(after.headers['idempotent-replayed'], 'true', 'the 422 did not overwrite the record')
    assert.equal(after.body, first.body)
    assert.equal(h.runs.get(key), 1, 'one execution for the key')
  }), fcParams(0xfa1afe1, 120))
  t.ok(byteDifferent > 100, `most retries were different bytes (${byteDifferent})`)
  t.same(h.errors, [], 'nothing was logged at error level')
})

t.test('raw: the same value written with other bytes is 422, the same bytes replay', async (t) => {
  const h = await fingerprintApp(t, { fingerprint: 'raw' })
  let n = 0
  await fc.assert(fc.asyncProperty(jsonObject, fc.gen(), async (value, g) => {
    const key = `raw-${n++}`
    const original = JSON.stringify(value)
    const other = reformat(value, g)
    fc.pre(other !== original)
    assert.equal((await send(h.app, key, original)).statusCode, 201)
    assert.equal((await send(h.app, key, original)).headers['idempotent-replayed'], 'true', 'the same bytes replay')
    assertProblem(await send(h.app, key, other), 'key-reused', 422, `${JSON.stringify(other)} vs ${original}`)
    assert.equal(h.runs.get(key), 1)
  }), fcParams(0xb17e5, 60))
  t.same(h.errors, [], 'nothing was logged at error level')
})

// ---------------------------------------------------------------------------------------------
// Edges of "the parsed body", measured: what the canonical form can and cannot tell apart

t.test('documented limits of canonical-v1: it compares the value the JSON parser produced', async (t) => {
  const h = await fingerprintApp(t)
  async function oneRequest (key: string, a: string, b: string, why: string): Promise<void> {
    t.equal((await send(h.app, key, a)).statusCode, 201, `${why}: first`)
    t.equal((await send(h.app, key, b)).headers['idempotent-replayed'], 'true', `${why}: ${a} and ${b} are one request`)
    t.equal(h.runs.get(key), 1, `${why}: one execution`)
  }
  async function twoRequests (key: string, a: string, b: string, why: string, url = '/orders'): Promise<void> {
    t.equal((await send(h.app, key, a)).statusCode, 201, `${why}: first`)
    const res = await send(h.app, key, b, url)
    t.doesNotThrow(() => assertProblem(res, 'key-reused', 422), `${why}: ${b} is another request than ${a} (422)`)
    t.equal(h.runs.get(key), 1, `${why}: one execution`)
  }

  // Integers past 2^53 are the same IEEE-754 double once parsed: the handler cannot tell them apart either.
  await oneRequest('big-int', '{"amount":9007199254740993}', '{"amount":9007199254740992}', 'integers past 2^53')
  // ECMAScript serialises -0 as 0 (as RFC 8785 §3.2.2.3 does).
  await oneRequest('minus-zero', '{"amount":-0}', '{"amount":0}', '-0 and 0')
  // RFC 8259 §4 leaves duplicate names to the parser; JSON.parse keeps the last.
  await oneRequest('duplicate-name', '{"amount":1,"amount":2}', '{"amount":2}', 'a duplicated member name')
  await oneRequest('escapes', '{"note":"caf\\u00e9 \\ud83d\\ude00 \\/"}', '{"note":"café 😀 /"}', 'escaped and raw characters')

  // No Unicode normalisation: canonically equivalent strings (NFC é, NFD e + U+0301) are other bytes.
  await twoRequests('nfc-nfd', '{"name":"\u00e9"}', '{"name":"e\u0301"}', 'NFC and NFD')
  await twoRequests('number-string', '{"amount":1}', '{"amount":"1"}', 'a number and a string')
  await twoRequests('array-order', '{"items":[1,2]}', '{"items":[2,1]}', 'array order')
  await twoRequests('null-member', '{"a":1}', '{"a":1,"b":null}', 'an added null member')
  // The target is part of the request as received, query order included.
  await twoRequests('query-order', '{"a":1}', '{"a":1}', 'the query in another order', '/orders?b=2&a=1')
  t.same(h.errors, [], 'nothing was logged at error level')
})

t.test('a prototype-poisoning body is refused by Fastify before the claim, so the key stays free', async (t) => {
  const h = await fingerprintApp(t)
  for (const body of ['{"__proto__":{"admin":true}}', '{"constructor":{"prototype":{"admin":true}}}']) {
    const res = await send(h.app, 'poison', body)
    t.equal(res.statusCode, 400, `${body}: 400 from the JSON parser`)
    t.equal(h.store.claims(), 0, `${body}: the store was not consulted`)
  }
  const clean = await send(h.app, 'poison', '{"admin":false}')
  t.equal(clean.statusCode, 201, 'the same key then executes with a clean body')
  t.equal(h.runs.get('poison'), 1)
})

t.test('form bodies from a form parser: pair order does not matter, values and repeated-name order do', async (t) => {
  const h = await fingerprintApp(t)
  // What @fastify/formbody does: the body parsed into an object by name (README: "from a form parser").
  h.app.addContentTypeParser('application/x-www-form-urlencoded', { parseAs: 'string' }, (_request, body, done) => {
    done(null, parseForm(body as string))
  })
  const form = (key: string, body: string): Promise<LightMyRequestResponse> => h.app.inject({
    method: 'POST', url: '/orders', headers: { 'idempotency-key': `"${key}"`, 'content-type': 'application/x-www-form-urlencoded' }, payload: body
  })
  const pairs = fc.uniqueArray(fc.tuple(fc.stringMatching(/^[a-z]{1,4}$/), fc.string({ unit: 'grapheme', maxLength: 6 })), { minLength: 1, maxLength: 5, selector: ([name]) => name })
  let n = 0
  await fc.assert(fc.asyncProperty(pairs, fc.gen(), async (fields, g) => {
    const key = `form-${n++}`
    const encode = (list: Array<[string, string]>): string => list.map(([name, value]) => `${name}=${encodeURIComponent(value)}`).join('&')
    const original = encode(fields)
    const shuffled = encode(g(fc.shuffledSubarray, fields, { minLength: fields.length }))
    const [name, value] = fields[0] as [string, string]
    const changed = encode([[name, `${value}x`], ...fields.slice(1)])
    assert.equal((await form(key, original)).statusCode, 201)
    assert.equal((await form(key, shuffled)).headers['idempotent-replayed'], 'true', `${shuffled} is ${original}`)
    assertProblem(await form(key, changed), 'key-reused', 422, `${changed} vs ${original}`)
    assert.equal(h.runs.get(key), 1)
  }), fcParams(0xf0a4, 60))
  // A repeated name parses to an array, whose order is meaning.
  t.equal((await form('repeated', 'a=1&a=2')).statusCode, 201)
  const swapped = await form('repeated', 'a=2&a=1')
  t.doesNotThrow(() => assertProblem(swapped, 'key-reused', 422), 'a=2&a=1 is another request than a=1&a=2 (422)')
  t.equal(h.runs.get('repeated'), 1)
})
