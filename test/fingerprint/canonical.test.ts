import fc from 'fast-check'
import t, { type Test } from 'tap'
import { CANONICAL, canonicalFingerprint, canonicalJson } from '../../lib/core/fingerprint.js'
import { referenceDigest, referenceJson } from '../helpers/canonical-reference.js'

/*
 * The canonical walk is iterative and hashes as it writes, and canonical-v1's
 * bytes must not change, or every stored record would stop matching its retries (422). The
 * reference (test/helpers/canonical-reference.ts) is the recursive implementation records were made
 * with (lib/core/fingerprint.ts at f203b40), copied verbatim: the new walk must give the same text and
 * the same digest for every input, generated or picked by hand.
 */

function same (t: Test, value: unknown, name: string): void {
  const expected = referenceJson(value)
  t.equal(canonicalJson(value), expected, `${name}: the same text`)
  const fingerprint = canonicalFingerprint('POST', '/pay?x=1', value, 'application/json')
  t.equal(fingerprint.algorithm, CANONICAL)
  t.equal(fingerprint.digest.toString('hex'), referenceDigest('POST', '/pay?x=1', value).toString('hex'), `${name}: the same digest`)
}

const LONG = 'x'.repeat(40_000)

const HAND_PICKED: ReadonlyArray<readonly [string, unknown]> = [
  ['null', null],
  ['booleans', [true, false]],
  ['numbers ECMAScript writes specially', [1e21, 1e-7, -0, 0, -1e-7, 5e-324, 1.7976931348623157e308, 0.1 + 0.2, 2 ** 53 + 2, -1e21, 123456789012345680000]],
  ['non-finite numbers', [NaN, Infinity, -Infinity, { n: NaN, i: -Infinity }]],
  ['parsed number spellings', JSON.parse('[1.0, 1e2, 1E-7, -0.50, 12345678901234567890, 0e0, -0.0]')],
  ['strings needing escapes', ['"', '\\', '\n\r\t\b\f', '\u0000\u001f\u007f', 'a"b\\c', '</script>', '\u2028\u2029']],
  ['unicode and surrogates', ['café ☕', '😀', '\ud83d', '\ude00', 'a\ud83db', '\ude00\ud83d', '日本語', '\ufffd', 'e\u0301']],
  ['keys needing escapes and sorting by code unit', { '"': 1, '\\': 2, '\n': 3, '😀': 4, '\ufffd': 5, '\ud83d': 6, é: 7, e: 8, B: 9, a: 10, _: 11 }],
  ['integer-like keys (Object.keys puts them first, sorting does not)', { 10: 'a', 9: 'b', 2: 'c', '01': 'd', '-1': 'e', b: 'f', 1.5: 'g' }],
  ['already sorted flat object', { a: 1, b: 'two', c: true, d: null, e: undefined }],
  ['unsorted flat object', { z: 1, a: 2, m: 'x' }],
  ['flat object with a function and a symbol member (null, not left out)', { a: () => 1, b: Symbol('s'), c: 1 }],
  ['array members without a JSON value', [undefined, () => 1, Symbol('s'), 1]],
  // eslint-disable-next-line no-sparse-arrays
  ['array with holes', [1, , 3]],
  ['undefined members', { a: undefined, b: { c: undefined }, d: [undefined] }],
  ['toJSON', { when: new Date(0), custom: { toJSON: () => ({ b: 1, a: [2, { d: 1, c: 0 }] }) }, undef: { toJSON: () => undefined } }],
  ['toJSON at the root', { toJSON: () => 'root' }],
  ['toJSON chain', { toJSON: () => ({ toJSON: () => [{ toJSON: () => 7 }] }) }],
  ['an array with its own toJSON (ignored, as before)', Object.assign([1, 2], { toJSON: () => 'no' })],
  ['Buffers', { bin: Buffer.from([0, 1, 2, 250, 251, 252]), empty: Buffer.alloc(0), list: [Buffer.from('hi')] }],
  ['a Uint8Array that is not a Buffer (an object keyed 0, 1, ...)', new Uint8Array([3, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11])],
  ['boxed primitives (objects without own keys)', [new Number(1), new String('s'), new Boolean(false)]], // eslint-disable-line no-new-wrappers
  ['a null-prototype object', Object.assign(Object.create(null) as object, { b: 1, a: 2 })],
  ['a class instance with sorted keys', new (class Point { a = 1; b = 2 })()],
  ['nested', { items: [{ sku: 'x', qty: 1 }, { qty: 2, sku: 'y', tags: [{ b: 1, a: 0 }] }], total: 3 }],
  ['empty containers', [[], {}, [[]], [{}], { a: [] }, { a: {} }]],
  ['a string longer than a chunk', { long: LONG, after: 1 }],
  ['many strings across chunk boundaries', Array.from({ length: 5_000 }, (_, i) => ({ ['k' + String(i % 7)]: 'é'.repeat(i % 13), n: i }))],
  ['a flat array longer than a chunk', Array.from({ length: 20_000 }, (_, i) => i * 1.25)],
  ['deep (500 levels), below any stack limit of the reference', nest(500)],
  ['deep and wide', Array.from({ length: 50 }, (_, i) => nest(40, i))]
]

function nest (depth: number, leaf: unknown = 'leaf'): unknown {
  let value: unknown = leaf
  for (let i = 0; i < depth; i++) value = i % 2 === 0 ? { [`k${i}`]: value, z: i } : [i, value]
  return value
}

t.test('the walk writes exactly what the recursive implementation wrote, on hand-picked values', async (t) => {
  for (const [name, value] of HAND_PICKED) same(t, value, name)
})

t.test('the walk writes exactly what the recursive implementation wrote, on generated values', async (t) => {
  const unicode = fc.string({ unit: 'binary', maxLength: 12 })
  const anyString = fc.oneof(unicode, fc.string({ unit: 'grapheme', maxLength: 8 }), fc.string({ maxLength: 8 }))
  const number = fc.oneof(fc.double(), fc.integer(), fc.constantFrom(1e21, -0, 1e-7, 5e-324, 2 ** 53))
  const { tree } = fc.letrec((tie) => ({
    tree: fc.oneof({ depthSize: 'small' }, tie('leaf'), tie('array'), tie('object')),
    leaf: fc.oneof(number, anyString, fc.boolean(), fc.constant(null), fc.constant(undefined)),
    array: fc.array(tie('tree'), { maxLength: 6 }),
    object: fc.dictionary(anyString, tie('tree'), { maxKeys: 6 })
  }))
  let checked = 0
  fc.assert(fc.property(tree, (value) => {
    checked++
    return canonicalJson(value) === referenceJson(value) &&
      canonicalFingerprint('POST', '/p', value, 'application/json').digest.equals(referenceDigest('POST', '/p', value))
  }), { numRuns: 3_000, seed: 16 })
  fc.assert(fc.property(fc.jsonValue(), (value) => canonicalJson(value) === referenceJson(value)), { numRuns: 2_000, seed: 17 })
  // Parsed JSON texts, whose objects are what body parsers hand over.
  fc.assert(fc.property(fc.json(), (text) => {
    const value: unknown = JSON.parse(text)
    return canonicalJson(value) === referenceJson(value)
  }), { numRuns: 2_000, seed: 18 })
  t.equal(checked, 3_000, 'every generated tree was compared')
})

t.test('canonical-v1 of a known request is, byte for byte, the digest stored records hold', async (t) => {
  // The SHA-256 of `POST\n/pay\njson:{"amount":100,"currency":"eur"}`, computed once and written out.
  const stored = '509bb910708bbdce6813172a2578ebc8661e384b2cf31a814e8b8f405a34817c'
  t.equal(canonicalFingerprint('POST', '/pay', { currency: 'eur', amount: 100 }, 'application/json').digest.toString('hex'), stored)
})

/*
 * Fingerprinting a large body cost about 5x parsing it (benchmarks/fingerprint.ts has
 * the ratios). Two causes, each checked here by what the walk does rather than by how long it
 * takes: one JSON.stringify call per value, and the whole canonical text built before hashing.
 */

/** How many times JSON.stringify runs while `fn` runs. */
function stringifyCalls (fn: () => void): number {
  const original = JSON.stringify
  let calls = 0
  JSON.stringify = function counted (this: unknown, ...args: Parameters<typeof JSON.stringify>) {
    calls++
    return original.apply(this, args)
  } as typeof JSON.stringify
  try {
    fn()
  } finally {
    JSON.stringify = original
  }
  return calls
}

t.test('values with a fast path are written without one JSON.stringify call each', async (t) => {
  const numbers: unknown = JSON.parse(JSON.stringify(Array.from({ length: 100_000 }, (_, i) => i * 3)))
  const records: unknown = JSON.parse(JSON.stringify(Array.from({ length: 10_000 }, (_, i) => ({ name: `item-${i}`, id: i, sku: 'ABC' }))))
  let calls = stringifyCalls(() => canonicalFingerprint('POST', '/p', numbers, 'application/json'))
  t.ok(calls <= 1, `a flat array of 100,000 numbers: ${calls} calls`)
  calls = stringifyCalls(() => canonicalFingerprint('POST', '/p', records, 'application/json'))
  t.ok(calls <= 10, `10,000 objects with unsorted members and plain strings: ${calls} calls`)
  // Strings that need escapes still go through JSON.stringify, which is what defines their text.
  calls = stringifyCalls(() => canonicalFingerprint('POST', '/p', { a: 'line\nbreak', b: 'quote"' }, 'application/json'))
  t.ok(calls >= 1, 'escapes are left to JSON.stringify')
})

t.test('the canonical text is handed to the hash in bounded chunks, never built whole', async (t) => {
  const { writeCanonical, UNLIMITED } = await import('../../lib/core/fingerprint-canonical.js')
  const body: unknown = JSON.parse(JSON.stringify(Array.from({ length: 30_000 }, (_, i) => ({ z: i, a: `é-${i}`, m: [i, { y: null, x: true }] }))))
  const chunks: string[] = []
  const rest = writeCanonical(body, UNLIMITED, 'POST\n/p\njson:', (chunk) => { chunks.push(chunk) })
  const whole = referenceJson(body)
  t.ok(whole.length > 1_000_000, `a large body (${whole.length} characters)`)
  t.ok(chunks.length > 20, `${chunks.length} chunks`)
  const longest = Math.max(...chunks.map((chunk) => chunk.length), rest.length)
  t.ok(longest < 40_000, `no chunk longer than about 32 Ki characters (longest ${longest})`)
  t.equal(chunks.join('') + rest, `POST\n/p\njson:${whole}`, 'together, exactly the canonical text')
})
