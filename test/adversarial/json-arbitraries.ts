import fc from 'fast-check'

/**
 * JSON values, and two ways of rewriting one, for the fingerprint properties:
 * - `reformat`: another JSON text of the SAME value (member order, whitespace, number notation,
 *   string escapes: what RFC 8259 leaves to the writer);
 * - `mutate`: a value that means something else (a changed leaf, an added or removed member, a
 *   reordered array, a changed type).
 */

export type Json = null | boolean | number | string | Json[] | { [name: string]: Json }
type Gen = fc.GeneratorValue

const text = fc.oneof(
  fc.string({ unit: 'grapheme', maxLength: 8 }),
  fc.string({ unit: 'binary', maxLength: 8 }),
  fc.constantFrom('', 'a', 'A', 'é', 'e\u0301', '😀', '\u0000', '"', '\\', '/', '\u2028', '\ud800')
)
// Fastify's JSON parser refuses bodies with these names (prototype poisoning): tested on their own.
const memberName = text.filter((name) => name !== '__proto__' && name !== 'constructor')
const number = fc.oneof(
  fc.integer({ min: -1_000_000, max: 1_000_000 }),
  fc.double({ noNaN: true, noDefaultInfinity: true }),
  fc.constantFrom(0, -0, 1, 0.1, 0.5, 100, 1e21, 1e-7, 123.456, 2 ** 53, -(2 ** 53), Number.MAX_VALUE, Number.MIN_VALUE)
)

export const jsonValue: fc.Arbitrary<Json> = fc.letrec<{ value: Json, array: Json[], object: Record<string, Json> }>((tie) => ({
  value: fc.oneof({ depthSize: 'small', withCrossShrink: true },
    fc.constant(null), fc.boolean(), number, text, tie('array'), tie('object')),
  array: fc.array(tie('value'), { maxLength: 4 }),
  object: fc.dictionary(memberName, tie('value'), { maxKeys: 5, noNullPrototype: true })
})).value

/** A JSON object (the usual request body) whose members are any JSON values. */
export const jsonObject: fc.Arbitrary<Record<string, Json>> = fc.dictionary(memberName, jsonValue, { minKeys: 1, maxKeys: 5, noNullPrototype: true })

/** Equality of meaning: members as a set, arrays in order, numbers by value (so -0 is 0, as ECMAScript serialises it). */
export function jsonEqual (a: Json, b: Json): boolean {
  if (a === null || b === null || typeof a !== 'object' || typeof b !== 'object') return a === b
  if (Array.isArray(a) || Array.isArray(b)) {
    return Array.isArray(a) && Array.isArray(b) && a.length === b.length && a.every((item, i) => jsonEqual(item, b[i] as Json))
  }
  const names = Object.keys(a)
  return names.length === Object.keys(b).length && names.every((name) => Object.hasOwn(b, name) && jsonEqual(a[name] as Json, b[name] as Json))
}

const WHITESPACE = ['', '', ' ', '\n', '\t', '\r\n', '   '] as const

/** Another JSON text for the same value. */
export function reformat (value: Json, g: Gen): string {
  const ws = (): string => g(fc.constantFrom, ...WHITESPACE)
  const write = (v: Json): string => {
    if (v === null || typeof v === 'boolean') return String(v)
    if (typeof v === 'number') return numberText(v, g)
    if (typeof v === 'string') return stringText(v, g)
    if (Array.isArray(v)) return `[${ws()}${v.map((item) => write(item)).join(`${ws()},${ws()}`)}${ws()}]`
    const names = g(fc.shuffledSubarray, Object.keys(v), { minLength: Object.keys(v).length })
    return `{${ws()}${names.map((name) => `${stringText(name, g)}${ws()}:${ws()}${write(v[name] as Json)}`).join(`${ws()},${ws()}`)}${ws()}}`
  }
  return ws() + write(value) + ws()
}

/** The same number in another notation: exponent forms, trailing zeros, leading zeros in the exponent. */
function numberText (n: number, g: Gen): string {
  if (n === 0) return g(fc.constantFrom, '0', '-0', '0.0', '-0.000', '0e0', '0E+5', '-0.0e-12')
  const sign = n < 0 ? '-' : ''
  const [mantissa = '', exponentText = ''] = Math.abs(n).toExponential().split('e')
  const exponent = Number(exponentText)
  const digits = mantissa.replace('.', '')
  // value = digits × 10^(exponent - (digits.length - 1)), exactly: every variant below is that decimal.
  const shift = exponent - (digits.length - 1)
  const variants = [
    JSON.stringify(n),
    `${sign}${digits}e${shift}`,
    `${sign}${digits}000E${shift - 3}`,
    `${sign}${digits[0] ?? ''}.${digits.slice(1)}000e${exponent >= 0 ? '+' : ''}${exponent}`,
    `${sign}0.${digits}e${exponent + 1}`,
    `${sign}${mantissa}e${exponent < 0 ? '-' : '+'}00${Math.abs(exponent)}`
  ]
  if (Number.isInteger(n) && Math.abs(n) < 1e21) variants.push(`${JSON.stringify(n)}.0`, `${JSON.stringify(n)}.000`)
  return g(fc.constantFrom, ...variants)
}

/** The same string with each character written raw or escaped (\uXXXX in either case, or a short escape). */
function stringText (s: string, g: Gen): string {
  let out = '"'
  for (const ch of s.split('')) {
    const code = ch.charCodeAt(0)
    const hex = code.toString(16).padStart(4, '0')
    const forms = [`\\u${hex}`, `\\u${hex.toUpperCase()}`]
    const short = ({ '"': '\\"', '\\': '\\\\', '/': '\\/', '\b': '\\b', '\f': '\\f', '\n': '\\n', '\r': '\\r', '\t': '\\t' } as Record<string, string>)[ch]
    if (short !== undefined) forms.push(short)
    // Surrogates stay escaped: the body goes out as UTF-8, which cannot carry a lone one.
    if (code >= 0x20 && ch !== '"' && ch !== '\\' && (code < 0xd800 || code > 0xdfff)) forms.push(ch, ch, ch)
    out += g(fc.constantFrom, ...forms)
  }
  return out + '"'
}

/** A value that means something else than `value` (never jsonEqual to it). */
export function mutate (value: Json, g: Gen): Json {
  const nodes: Array<{ get: () => Json, set: (v: Json) => Json }> = []
  const collect = (v: Json, rebuild: (replacement: Json) => Json): void => {
    nodes.push({ get: () => v, set: rebuild })
    if (v === null || typeof v !== 'object') return
    if (Array.isArray(v)) {
      v.forEach((item, i) => collect(item, (r) => rebuild(v.map((x, j) => (j === i ? r : x)))))
    } else {
      for (const name of Object.keys(v)) collect(v[name] as Json, (r) => rebuild({ ...v, [name]: r }))
    }
  }
  collect(value, (r) => r)
  const node = nodes[g(fc.nat, nodes.length - 1)] as (typeof nodes)[number]
  const current = node.get()
  const candidates: Json[] = [...otherValues(current, g)]
  if (current !== null && typeof current === 'object') {
    if (Array.isArray(current)) {
      candidates.push([...current, 0], current.slice(1), [...current].reverse())
    } else {
      const names = Object.keys(current)
      const added = g(() => memberName.filter((name) => !Object.hasOwn(current, name)))
      candidates.push({ ...current, [added]: null })
      if (names.length > 0) {
        const { [names[0] as string]: _removed, ...rest } = current
        candidates.push(rest)
      }
    }
  }
  // Only values JSON can carry (Infinity cannot), and only different ones.
  const different = candidates.filter((c) => jsonEqual(JSON.parse(JSON.stringify(c)) as Json, c) && !jsonEqual(c, current))
  return node.set(different[g(fc.nat, different.length - 1)] as Json)
}

/** Leaves of other values or types: a number changed by one, a string with a character more, the other boolean… */
function otherValues (current: Json, g: Gen): Json[] {
  const out: Json[] = [null, true, false, 0, '', [], {}, [current]]
  if (typeof current === 'number') out.push(current + 1, -current - 1, String(current), current * 2)
  if (typeof current === 'string') out.push(current + g(fc.constantFrom, 'x', ' ', '\u0301', '😀'), current.slice(1), current.toUpperCase(), Number(current.length))
  if (typeof current === 'boolean') out.push(!current, String(current))
  return out
}
