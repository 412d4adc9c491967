import assert from 'node:assert/strict'
import fc from 'fast-check'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type KeyFormat } from '../../lib/index.js'
import { parseKey } from '../../lib/http/key.js'
import { referenceKey, type Verdict } from './sf-reference.js'
import { assertProblem, counted, errorLog, fcParams, json, type CountedStore } from './support.js'

/*
 * Key parsing against the RFC 9651 grammar (draft §2.1: the field is an Item whose value is an
 * sf-string, §3.3.3 / §4.2.5), with fast-check: every valid sf-string round-trips to the handler as
 * its value, everything else is a 400 key-invalid problem, and nothing ends in a 500. The expected
 * answer comes from sf-reference.ts, written from the RFC's parsing algorithms, not from lib/http/key.ts.
 */

const ONE_LINE = ['Idempotency-Key', 'x']
const MAX = 255

// ---------------------------------------------------------------------------------------------
// Generators

const printable = fc.integer({ min: 0x20, max: 0x7e }).map((code) => String.fromCharCode(code))
/** The value of an sf-string: any printable ASCII, quotes and backslashes included. */
const keyText = fc.string({ unit: printable, minLength: 1, maxLength: 40 })
/** RFC 9651 §4.1.6 Serializing a String. */
const quote = (text: string): string => `"${text.replace(/[\\"]/g, (c) => `\\${c}`)}"`

/** RFC 9651 §4.1.11 Serializing a Display String: UTF-8, with %, " and non-VCHAR bytes percent-encoded. */
function displayString (text: string): string {
  let out = '%"'
  for (const byte of Buffer.from(text, 'utf8')) {
    out += byte === 0x25 || byte === 0x22 || byte < 0x20 || byte > 0x7e ? `%${byte.toString(16).padStart(2, '0')}` : String.fromCharCode(byte)
  }
  return out + '"'
}

const MAX_INTEGER = 999_999_999_999_999
/** Every kind of bare item a parameter value can be (RFC 9651 §3.3), serialised. */
const bareItem = fc.oneof(
  fc.integer({ min: -MAX_INTEGER, max: MAX_INTEGER }).map(String),
  fc.tuple(fc.integer({ min: -999_999_999_999, max: 999_999_999_999 }), fc.stringMatching(/^[0-9]{1,3}$/)).map(([whole, fraction]) => `${whole}.${fraction}`),
  fc.string({ unit: printable, maxLength: 10 }).map(quote),
  fc.stringMatching(/^[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]{0,8}$/),
  fc.uint8Array({ maxLength: 12 }).map((bytes) => `:${Buffer.from(bytes).toString('base64')}:`),
  fc.constantFrom('?0', '?1'),
  fc.string({ unit: 'grapheme', maxLength: 6 }).map(displayString)
)
/**
 * A Date parameter (RFC 9651 §3.3.7) only as the last thing in the field: structured-headers 2.1.0,
 * the parser the plugin uses, reads a Date to the end of the input, so it refuses a valid field with
 * anything after one (see the targeted cases below, which pin that).
 */
const lastDate = fc.option(fc.tuple(fc.stringMatching(/^[a-z*][a-z0-9_\-.*]{0,6}$/), fc.integer({ min: -MAX_INTEGER, max: MAX_INTEGER }))
  .map(([name, seconds]) => `;${name}=@${seconds}`))
const parameter = fc.tuple(fc.constantFrom('', ' ', '  '), fc.stringMatching(/^[a-z*][a-z0-9_\-.*]{0,6}$/), fc.option(bareItem))
  .map(([space, name, value]) => `;${space}${name}${value === null ? '' : `=${value}`}`)

/** A valid field value and the key it carries: SP* sf-string parameters SP* (RFC 9651 §4.2). */
const validField = fc.tuple(fc.constantFrom('', ' ', '   '), keyText, fc.array(parameter, { maxLength: 3 }), fc.constantFrom('', ' ', '  '), lastDate)
  .map(([lead, key, parameters, trail, date]) => ({
    value: date === null ? `${lead}${quote(key)}${parameters.join('')}${trail}` : `${lead}${quote(key)}${parameters.join('')}${date}`,
    key,
    parameters: parameters.length + (date === null ? 0 : 1)
  }))

/** Characters that matter to the grammar, plus controls and non-ASCII (latin1, BMP, astral, a lone surrogate). */
const HOSTILE_CHARS = ['"', '\\', ';', '=', ',', ' ', '\t', '(', ')', ':', '?', '@', '%', '*', 'a', 'Z', '0', '9', '-', '.', '\'',
  '\u0000', '\r', '\n', '\u007f', '\u00e9', '\u0141', '\ud83d', '😀', 'e\u0301']
const hostileChar = fc.constantFrom(...HOSTILE_CHARS)

/** One edit (insert, delete or replace a hostile character) of a valid field: near misses. */
const nearMiss = fc.tuple(validField, fc.nat(), hostileChar, fc.constantFrom('insert', 'delete', 'replace'))
  .map(([{ value }, at, ch, edit]) => {
    const i = at % (value.length + 1)
    if (edit === 'insert') return value.slice(0, i) + ch + value.slice(i)
    if (edit === 'delete') return value.slice(0, i) + value.slice(i + 1)
    return value.slice(0, i) + ch + value.slice(i + 1)
  })

/** Other Structured Field shapes a client might send instead of an sf-string. */
const otherShapes = fc.oneof(
  fc.tuple(keyText, keyText).map(([a, b]) => `${quote(a)}, ${quote(b)}`), // a list
  fc.array(keyText, { minLength: 1, maxLength: 3 }).map((items) => `(${items.map(quote).join(' ')})`), // an inner list
  fc.tuple(fc.stringMatching(/^[a-z][a-z0-9]{0,4}$/), keyText).map(([name, key]) => `${name}=${quote(key)}`), // a dictionary
  bareItem, // a bare item that is not a string (or a string: then it is valid)
  keyText.map((key) => `'${key}'`), // single quotes
  keyText.map((key) => `"${key}`), // unterminated
  keyText.map((key) => `${quote(key)}\\`), // a stray backslash after the closing quote
  fc.tuple(keyText, printable).map(([key, ch]) => `"${key}\\${ch}"`) // an escape of any character
)

/** Any header value: arbitrary code units, hostile-alphabet strings, near misses and other shapes. */
const anyField = fc.oneof(
  fc.string({ unit: 'binary', maxLength: 30 }),
  fc.string({ unit: hostileChar, maxLength: 30 }),
  nearMiss,
  otherShapes,
  validField.map(({ value }) => value)
)

/** What parseKey must answer: the reference verdict, then the length rules (README: maxKeyLength, empty keys). */
function expected (value: string, format: KeyFormat, max: number): Verdict {
  const verdict = libraryDeviation(value, format) ?? referenceKey(value, format)
  if (verdict.verdict === 'invalid') return verdict
  return verdict.key.length === 0 || verdict.key.length > max ? { verdict: 'invalid' } : verdict
}

/**
 * Where structured-headers 2.1.0 (the parser the plugin uses) answers otherwise than RFC 9651, the
 * library's answer: it accepts a Display String parameter holding a character above U+00FF (which
 * no HTTP/1.1 message can carry: Node reads field bytes as latin1; only inject can send one). Date
 * parameters followed by more input, which it refuses, are kept out of the generators and pinned
 * by the targeted cases. Null where the library follows the RFC.
 */
function libraryDeviation (value: string, format: KeyFormat): Verdict | null {
  // eslint-disable-next-line no-control-regex -- Latin-1, controls included
  if (!/[^\u0000-\u00ff]/u.test(value)) return null
  // eslint-disable-next-line no-control-regex -- as above
  const relaxed = value.replace(/%"[^"]*"/g, (display) => display.replace(/[^\u0000-\u00ff]/gu, 'x'))
  if (relaxed === value) return null
  const verdict = referenceKey(relaxed, format)
  return verdict.verdict === 'valid' ? verdict : null
}

const show = (value: string): string => JSON.stringify(value)

/** Counts what a valid field exercised, so a test can check its generator covered the grammar. */
function countShapes (shapes: { escapes: number, parameters: number, spaces: number }, field: { value: string, key: string, parameters: number }): void {
  if (/["\\]/.test(field.key)) shapes.escapes++
  if (field.parameters > 0) shapes.parameters++
  if (field.value !== field.value.trim()) shapes.spaces++
}

// ---------------------------------------------------------------------------------------------
// parseKey against the reference, without HTTP (cheap, so many runs)

t.test('parseKey agrees with the RFC 9651 reference on any header value, in both formats', async (t) => {
  const counts = { valid: 0, invalid: 0 }
  const property = fc.property(anyField, fc.constantFrom<KeyFormat>('strict', 'lenient'), fc.constantFrom(1, 8, 40, MAX),
    (value, format, max) => {
      const want = expected(value, format, max)
      const got = parseKey(value, ONE_LINE, format, max)
      if (want.verdict === 'valid') assert.deepEqual(got, { ok: true, key: want.key }, `${show(value)} (${format}) is the key ${show(want.key)}`)
      else if (want.verdict === 'invalid') assert.equal(got.ok ? 'accepted' : got.reason, 'invalid', `${show(value)} (${format}) is invalid`)
      else if (got.ok) assert.equal(got.key, want.key, `${show(value)} (${format}), if accepted, is the key ${show(want.key)}`)
      counts[got.ok ? 'valid' : 'invalid']++
    })
  fc.assert(property, fcParams(0x5f3759df, 5000))
  // The generators must exercise both sides, or the property says little.
  t.ok(counts.valid > 500, `many values were valid keys (${counts.valid})`)
  t.ok(counts.invalid > 500, `many values were invalid (${counts.invalid})`)
})

t.test('every valid sf-string, with any parameters and surrounding spaces, is read as its value', async (t) => {
  const shapes = { escapes: 0, parameters: 0, spaces: 0 }
  fc.assert(fc.property(validField, fc.constantFrom<KeyFormat>('strict', 'lenient'), (field, format) => {
    assert.deepEqual(parseKey(field.value, ONE_LINE, format, MAX), { ok: true, key: field.key }, `${show(field.value)} (${format})`)
    countShapes(shapes, field)
  }), fcParams(0x1de4, 3000))
  t.ok(shapes.escapes > 300 && shapes.parameters > 300 && shapes.spaces > 300, `escapes, parameters and spaces were all exercised (${JSON.stringify(shapes)})`)
})

t.test('the key length limit counts the unescaped value: accepted exactly when 1 <= length <= maxKeyLength', async (t) => {
  const counts = { accepted: 0, refused: 0 }
  fc.assert(fc.property(fc.string({ unit: printable, maxLength: 300 }), fc.integer({ min: 1, max: 300 }), (key, max) => {
    const got = parseKey(quote(key), ONE_LINE, 'strict', max)
    const fits = key.length >= 1 && key.length <= max
    assert.deepEqual(got.ok, fits, `a ${key.length}-character key with maxKeyLength ${max}`)
    counts[fits ? 'accepted' : 'refused']++
  }), fcParams(0xbadc0de, 2000))
  t.ok(counts.accepted > 100 && counts.refused > 100, `both sides of the limit were exercised (${counts.accepted} / ${counts.refused})`)
})

// ---------------------------------------------------------------------------------------------
// Through app.inject: the key the handler sees, the 400 problem, and no 500

interface KeyApp {
  readonly app: FastifyInstance
  readonly store: CountedStore
  readonly runs: () => number
  /** request.idempotency.key of the last request that reached onResponse (replays included). */
  readonly lastKey: () => string | null
  readonly errors: string[]
}

async function keyApp (t: Test, keyFormat: KeyFormat): Promise<KeyApp> {
  const log = errorLog()
  const app = Fastify({ logger: log.logger })
  const store = counted(memoryStore({ purgeInterval: 0 }))
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: () => 'test', keyFormat })
  let runs = 0
  let lastKey: string | null = null
  app.addHook('onResponse', async (request) => { lastKey = request.idempotency?.key ?? null })
  app.post('/orders', async (request, reply) => {
    runs++
    return reply.code(201).send({ key: request.idempotency?.key })
  })
  return { app, store, runs: () => runs, lastKey: () => lastKey, errors: log.lines }
}

const post = (app: FastifyInstance, value: string): Promise<LightMyRequestResponse> =>
  app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': value, 'content-type': 'application/json' }, payload: { amount: 1 } })

for (const format of ['strict', 'lenient'] as const) {
  t.test(`${format}: any valid sf-string reaches the handler as request.idempotency.key, and replays`, async (t) => {
    const h = await keyApp(t, format)
    const shapes = { escapes: 0, parameters: 0, spaces: 0 }
    await fc.assert(fc.asyncProperty(validField, async (field) => {
      const { value, key } = field
      const res = await post(h.app, value)
      assert.equal(res.statusCode, 201, `${show(value)}: ${res.body}`)
      assert.equal(json(res).key, key, `${show(value)}: the handler saw the value`)
      assert.equal(h.lastKey(), key, `${show(value)}: request.idempotency.key`)
      const again = await post(h.app, quote(key))
      assert.equal(again.headers['idempotent-replayed'], 'true', `${show(value)}: the plainly quoted key is the same key`)
      assert.equal(again.body, res.body)
      countShapes(shapes, field)
    }), fcParams(0xfeed, 200))
    t.ok(shapes.escapes > 20 && shapes.parameters > 20 && shapes.spaces > 20, `escapes, parameters and spaces were all sent (${JSON.stringify(shapes)})`)
    t.same(h.errors, [], 'nothing was logged at error level')
  })

  t.test(`${format}: any header value is either the reference key (201) or a 400 key-invalid problem; never a 500`, async (t) => {
    const h = await keyApp(t, format)
    const counts = { accepted: 0, refused: 0 }
    await fc.assert(fc.asyncProperty(anyField, async (value) => {
      const want = expected(value, format, MAX)
      const runsBefore = h.runs()
      const claimsBefore = h.store.claims()
      const res = await post(h.app, value)
      if (res.statusCode === 201 && want.verdict !== 'invalid') {
        assert.equal(json(res).key, want.key, `${show(value)}: the key`)
        assert.equal(h.lastKey(), want.key, `${show(value)}: request.idempotency.key`)
        counts.accepted++
        return
      }
      assert.notEqual(want.verdict, 'valid', `${show(value)} is valid (key ${show(want.verdict === 'valid' ? want.key : '')}) but got ${res.statusCode} ${res.body}`)
      assertProblem(res, 'key-invalid', 400, show(value))
      assert.equal(h.runs(), runsBefore, `${show(value)}: the handler did not run`)
      assert.equal(h.store.claims(), claimsBefore, `${show(value)}: the store was not consulted`)
      counts.refused++
    }), fcParams(0xc0ffee, 400))
    t.ok(counts.accepted > 40, `valid keys were among them (${counts.accepted})`)
    t.ok(counts.refused > 100, `invalid values were among them (${counts.refused})`)
    t.same(h.errors, [], 'nothing was logged at error level (no 500, no crash in a hook)')
  })
}

// ---------------------------------------------------------------------------------------------
// Targeted values, each with its reason

const TARGETED: ReadonlyArray<readonly [string, string, string | null]> = [
  // [what, field value, key or null for 400]
  ['unbalanced: no closing quote', '"abc', null],
  ['unbalanced: no opening quote', 'abc"', null],
  ['unbalanced: an escaped closing quote', '"abc\\"', null],
  ['three quotes', '"a"b"', null],
  ['escape of n', '"a\\nb"', null],
  ['escape of a space', '"a\\ b"', null],
  ['escaped quote and backslash', '"a\\"b\\\\c"', 'a"b\\c'],
  ['a parameter', '"abc";a=1', 'abc'],
  ['parameters of every type', '"abc";i=-12;d=1.5;s="x";t=tok/en:1;b=:YWJj:;q=?0;u=%"caf%c3%a9";f;w=@1700000000', 'abc'],
  // Valid per RFC 9651 §4.2.9, refused by structured-headers 2.1.0 (its Date parser reads to the end
  // of the input). Pinned: if the library is fixed, these fail and the README's note goes.
  ['a date parameter followed by another parameter (structured-headers 2.1.0 refuses it)', '"abc";d=@1659578233;x', null],
  ['a date parameter followed by spaces (structured-headers 2.1.0 refuses it)', '"abc";d=@1 ', null],
  ['a date parameter last', '"abc";x;d=@1659578233', 'abc'],
  ['a space before ";"', '"abc" ;a=1', null],
  ['an upper-case parameter name', '"abc";A=1', null],
  ['a parameter without a name', '"abc";=1', null],
  ['a parameter with an empty value', '"abc";a=', null],
  ['a decimal parameter with four fraction digits', '"abc";a=1.2345', null],
  ['a 16-digit integer parameter', '"abc";a=1234567890123456', null],
  ['a date parameter with a fraction', '"abc";a=@1.5', null],
  ['a display-string parameter with upper-case hex', '"abc";a=%"%C3%A9"', null],
  ['a display-string parameter that is not UTF-8', '"abc";a=%"%ff"', null],
  // Invalid (§4.2.10 allows VCHAR only), accepted by structured-headers 2.1.0 for characters above
  // U+00FF, which no HTTP/1.1 message can carry (Node reads field bytes as latin1); inject can.
  ['a display-string parameter with a character above U+00FF (only inject can send it)', '"abc";a=%"\u0141"', 'abc'],
  ['a display-string parameter with a latin1 character', '"abc";a=%"\u00e9"', null],
  ['a non-ASCII byte in a parameter string', '"abc";a="\u00e9"', null],
  ['an inner list', '("a" "b")', null],
  ['a list of two strings', '"a", "b"', null],
  ['a dictionary', 'a="b"', null],
  ['a byte sequence', ':YWJj:', null],
  ['an integer', '42', null],
  ['a boolean', '?1', null],
  ['a display string', '%"abc"', null],
  ['a date', '@1700000000', null],
  ['trailing data', '"abc"x', null],
  ['a tab before the value (inject keeps what Node strips)', '\t"abc"', null],
  ['a NUL inside', '"a\u0000b"', null],
  ['CR LF inside', '"a\r\nb"', null],
  ['an astral character', '"😀"', null],
  ['a combining sequence', '"e\u0301"', null],
  ['a lone surrogate', '"\ud800"', null]
]

for (const format of ['strict', 'lenient'] as const) {
  t.test(`${format}: targeted values`, async (t) => {
    const h = await keyApp(t, format)
    for (const [what, value, key] of TARGETED) {
      // Lenient mode reads a value without a leading quote as a bare key: a different grammar.
      const bare = format === 'lenient' && !/^ *"/.test(value)
      const want = bare ? (referenceKey(value, 'lenient').verdict === 'valid' ? value : null) : key
      const runsBefore = h.runs()
      const res = await post(h.app, value)
      if (want === null) {
        t.doesNotThrow(() => assertProblem(res, 'key-invalid', 400, what), `${what} (${show(value)}) is a 400 key-invalid problem`)
        t.equal(h.runs(), runsBefore, `${what}: the handler did not run`)
      } else {
        t.equal(res.statusCode, 201, `${what} (${show(value)}) is accepted`)
        t.equal(h.lastKey(), want, `${what}: the key is ${show(want)}`)
      }
    }
    t.same(h.errors, [], 'nothing was logged at error level')
  })
}
