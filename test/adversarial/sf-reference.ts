/**
 * An independent reading of the Idempotency-Key grammar, written from the RFC 9651 parsing
 * algorithms (§4.2) rather than from lib/http/key.ts, so the property tests compare two implementations
 * instead of one implementation with itself.
 *
 * Only what an Item field whose bare item is an sf-string needs: the string (§4.2.5), and the
 * parameters (§4.2.3.2) with every kind of bare item a parameter value may be (§4.2.3.1), since a
 * malformed parameter makes the whole field malformed.
 */

/**
 * `valid`: the field parses and its value is this key. `invalid`: RFC 9651 says fail parsing (or
 * the item is not a string). `either`: a byte sequence whose base64 is not canonical, where the RFC
 * lets parsers choose (§4.2.7: they SHOULD NOT fail on missing padding, MAY fail on non-zero
 * padding bits); the key is what a parser that accepts it returns.
 */
export type Verdict =
  | { readonly verdict: 'valid', readonly key: string }
  | { readonly verdict: 'either', readonly key: string }
  | { readonly verdict: 'invalid' }

const INVALID: Verdict = { verdict: 'invalid' }

/** What lenient mode accepts besides an sf-string: visible ASCII without `"`, `'` and `,` (README, option keyFormat). */
const BARE = /^[\x21\x23-\x26\x28-\x2b\x2d-\x7e]+$/

/** The key (before the length limits) that `format` reads from one field line, per RFC 9651 and the README. */
export function referenceKey (value: string, format: 'strict' | 'lenient'): Verdict {
  if (format === 'lenient' && !/^ *"/.test(value)) return BARE.test(value) ? { verdict: 'valid', key: value } : INVALID
  return parseStringItem(value)
}

class Fail extends Error {}

/** A cursor over the field value; every `fail()` is RFC 9651's "fail parsing". */
class Cursor {
  pos = 0
  lenient = false
  constructor (readonly input: string) {}
  get done (): boolean { return this.pos >= this.input.length }
  peek (): string { return this.input[this.pos] ?? '' }
  take (): string {
    if (this.done) throw new Fail()
    return this.input[this.pos++] as string
  }

  skipSpaces (): void { while (this.peek() === ' ') this.pos++ }
}

function parseStringItem (input: string): Verdict {
  // §4.2 step 1: the field value must convert to ASCII.
  // eslint-disable-next-line no-control-regex -- ASCII, controls included (RFC 9651 §4.2)
  if (!/^[\x00-\x7f]*$/.test(input)) return INVALID
  const c = new Cursor(input)
  try {
    c.skipSpaces() // §4.2 step 3
    if (c.peek() !== '"') return INVALID // any other bare item type is not a key (draft §2.1)
    const key = sfString(c)
    parameters(c)
    c.skipSpaces() // §4.2 step 6
    if (!c.done) return INVALID // §4.2 step 7
    return { verdict: c.lenient ? 'either' : 'valid', key }
  } catch (err) {
    if (err instanceof Fail) return INVALID
    throw err
  }
}

const DIGIT = /^[0-9]$/
const LCALPHA = /^[a-z]$/
const KEY_CHAR = /^[a-z0-9_\-.*]$/
const TOKEN_CHAR = /^[!#$%&'*+\-.^_`|~0-9A-Za-z:/]$/

/** §4.2.5 Parsing a String. */
function sfString (c: Cursor): string {
  if (c.take() !== '"') throw new Fail()
  let out = ''
  for (;;) {
    const ch = c.take()
    if (ch === '\\') {
      const next = c.take()
      if (next !== '"' && next !== '\\') throw new Fail()
      out += next
    } else if (ch === '"') {
      return out
    } else {
      const code = ch.charCodeAt(0)
      if (code < 0x20 || code > 0x7e) throw new Fail()
      out += ch
    }
  }
}

/** §4.2.3.2 Parsing Parameters (values are validated and dropped: the key ignores them). */
function parameters (c: Cursor): void {
  while (c.peek() === ';') {
    c.pos++
    c.skipSpaces()
    parameterKey(c)
    if (c.peek() === '=') {
      c.pos++
      bareItem(c)
    }
  }
}

/** §4.2.3.3 Parsing a Key. */
function parameterKey (c: Cursor): void {
  const first = c.peek()
  if (!LCALPHA.test(first) && first !== '*') throw new Fail()
  while (KEY_CHAR.test(c.peek())) c.pos++
}

/** §4.2.3.1 Parsing a Bare Item. */
function bareItem (c: Cursor): void {
  const first = c.peek()
  if (first === '-' || DIGIT.test(first)) { integerOrDecimal(c); return }
  if (first === '"') { sfString(c); return }
  if (/^[A-Za-z*]$/.test(first)) { while (TOKEN_CHAR.test(c.peek())) c.pos++; return }
  if (first === ':') { byteSequence(c); return }
  if (first === '?') { c.pos++; const b = c.take(); if (b !== '0' && b !== '1') throw new Fail(); return }
  if (first === '@') { c.pos++; if (integerOrDecimal(c) !== 'integer') throw new Fail(); return }
  if (first === '%') { displayString(c); return }
  throw new Fail()
}

/** §4.2.4 Parsing an Integer or a Decimal. */
function integerOrDecimal (c: Cursor): 'integer' | 'decimal' {
  let type: 'integer' | 'decimal' = 'integer'
  let number = ''
  if (c.peek() === '-') c.pos++
  if (!DIGIT.test(c.peek())) throw new Fail()
  while (!c.done) {
    const ch = c.peek()
    if (DIGIT.test(ch)) {
      number += ch
    } else if (type === 'integer' && ch === '.') {
      if (number.length > 12) throw new Fail()
      number += ch
      type = 'decimal'
    } else {
      break
    }
    c.pos++
    if (type === 'integer' && number.length > 15) throw new Fail()
    if (type === 'decimal' && number.length > 16) throw new Fail()
  }
  if (type === 'decimal') {
    if (number.endsWith('.')) throw new Fail()
    if ((number.split('.')[1] ?? '').length > 3) throw new Fail()
  }
  return type
}

/** §4.2.7 Parsing a Byte Sequence. */
function byteSequence (c: Cursor): void {
  c.pos++
  const end = c.input.indexOf(':', c.pos)
  if (end === -1) throw new Fail()
  const content = c.input.slice(c.pos, end)
  c.pos = end + 1
  if (!/^[A-Za-z0-9+/=]*$/.test(content)) throw new Fail()
  if (!isCanonicalBase64(content)) c.lenient = true
}

function isCanonicalBase64 (text: string): boolean {
  if (!/^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/.test(text)) return false
  return Buffer.from(Buffer.from(text, 'base64').toString('base64')).toString() === text
}

/** §4.2.10 Parsing a Display String. */
function displayString (c: Cursor): void {
  c.pos++
  if (c.take() !== '"') throw new Fail()
  const bytes: number[] = []
  for (;;) {
    const ch = c.take()
    const code = ch.charCodeAt(0)
    if (code <= 0x1f || code >= 0x7f) throw new Fail()
    if (ch === '%') {
      const hex = c.take() + c.take()
      if (!/^[0-9a-f]{2}$/.test(hex)) throw new Fail()
      bytes.push(parseInt(hex, 16))
    } else if (ch === '"') {
      try {
        new TextDecoder('utf-8', { fatal: true }).decode(new Uint8Array(bytes))
      } catch {
        throw new Fail()
      }
      return
    } else {
      bytes.push(code)
    }
  }
}
