import { isUtf8 } from 'node:buffer'

export type KeyFormat = 'strict' | 'lenient'

export type ParsedKey =
  | { readonly ok: true, readonly key: string }
  | { readonly ok: false, readonly reason: 'missing' | 'invalid', readonly detail: string }

const HEADER = 'idempotency-key'

const MISSING: ParsedKey = { ok: false, reason: 'missing', detail: 'This operation requires an Idempotency-Key request header.' }

function invalid (detail: string): ParsedKey {
  return { ok: false, reason: 'invalid', detail }
}

/**
 * Reads the Idempotency-Key field value. The draft (§2.1) makes it an Item Structured Field whose
 * value is an sf-string (RFC 9651 §3.3.3): `"..."` with only `\"` and `\\` escapes, printable ASCII,
 * parameters allowed and ignored (RFC 9651 §2: unknown parameters are not an error).
 *
 * `lenient` also accepts a bare value of visible ASCII without whitespace, quotes or commas, which
 * is what most real clients send (an unquoted UUID, Stripe's `stripe-node-retry-<uuid>`).
 *
 * Every failure is "treat the message as malformed" (RFC 9651 §4.2), answered with 400: silently
 * ignoring a key the client believes protects a payment would be worse.
 */
export function parseKey (
  value: string | string[] | undefined,
  rawHeaders: readonly string[],
  format: KeyFormat,
  maxLength: number
): ParsedKey {
  if (value === undefined) return MISSING
  // Node joins repeated field lines with ", " (and inject may hand us an array). An Item field
  // must not be sent twice (RFC 9110 §5.3); a joined `"foo` + `bar"` would even parse, so the
  // field lines themselves are counted whenever a comma makes a join possible.
  if (typeof value !== 'string') return invalid('The Idempotency-Key header must be sent once.')
  if (value.includes(',') && countFieldLines(rawHeaders) > 1) {
    return invalid('The Idempotency-Key header must be sent once.')
  }

  const key = format === 'strict' || startsWithQuote(value)
    ? readSfString(value)
    : readBareValue(value)
  if (typeof key !== 'string') return key
  if (key.length === 0) return invalid('The Idempotency-Key must not be empty.')
  if (key.length > maxLength) return invalid(`The Idempotency-Key must be at most ${maxLength} characters long.`)
  return { ok: true, key }
}

/** Leading SP is not part of an sf-string (RFC 9651 §4.2); inject() keeps what Node would strip. */
function startsWithQuote (value: string): boolean {
  let i = 0
  while (value.charCodeAt(i) === 0x20) i++
  return value.charCodeAt(i) === 0x22
}

function countFieldLines (rawHeaders: readonly string[]): number {
  let lines = 0
  for (let i = 0; i < rawHeaders.length; i += 2) {
    const name = rawHeaders[i]
    if (name !== undefined && name.length === HEADER.length && name.toLowerCase() === HEADER) lines++
  }
  return lines
}

function readSfString (value: string): string | ParsedKey {
  // Fast path for the common `"<printable ASCII without \ or ">"`; anything else (escapes,
  // parameters, surrounding spaces, every malformed value) goes through the full grammar below.
  const last = value.length - 1
  if (last > 0 && value.charCodeAt(0) === 0x22 && value.charCodeAt(last) === 0x22) {
    let simple = true
    for (let i = 1; i < last; i++) {
      const c = value.charCodeAt(i)
      if (c < 0x20 || c > 0x7e || c === 0x22 || c === 0x5c) { simple = false; break }
    }
    if (simple) return value.slice(1, last)
  }
  const start = skipSpaces(value, 0)
  if (value.charCodeAt(start) !== 0x22) return invalid('The Idempotency-Key must be a string (a quoted value), not another Structured Field type.')
  const key = parseStringItem(value, start)
  if (key === null) return invalid('The Idempotency-Key must be a Structured Field string, such as "8e03978e-40d5-43e8-bc93-6894a57f9324".')
  return key
}

/*
 * RFC 9651 §4.2 for an Item whose bare item is a String, written out because the key needs only
 * this much and structured-headers 2.1.0 gets part of it wrong: its Date parser reads to the end of
 * the input, so a valid `"k";d=@1659578233;x` (or a trailing space after a Date) failed, although
 * §4.2.9 stops at the first non-digit. Parameters are validated, since a malformed one makes the
 * whole field malformed, and then ignored (§2). Each function returns the index after what it
 * read, or -1 for "fail parsing".
 */

/** SP* string parameters SP* (§4.2 steps 3-7), from `start` (a DQUOTE). */
function parseStringItem (value: string, start: number): string | null {
  const end = skipString(value, start)
  if (end < 0) return null
  const rest = skipParameters(value, end)
  if (rest < 0 || skipSpaces(value, rest) !== value.length) return null
  return value.slice(start + 1, end - 1).replace(/\\(.)/g, '$1')
}

function skipSpaces (value: string, i: number): number {
  while (value.charCodeAt(i) === 0x20) i++
  return i
}

/** §4.2.5: printable ASCII, with `\"` and `\\` as the only escapes. */
function skipString (value: string, i: number): number {
  if (value.charCodeAt(i) !== 0x22) return -1
  for (i++; i < value.length; i++) {
    const c = value.charCodeAt(i)
    if (c === 0x22) return i + 1
    if (c === 0x5c) {
      const next = value.charCodeAt(++i)
      if (next !== 0x22 && next !== 0x5c) return -1
    } else if (c < 0x20 || c > 0x7e) {
      return -1
    }
  }
  return -1
}

const PARAMETER_KEY = /[a-z*][a-z0-9_.*-]*/y
const TOKEN = /[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]*/y
const BYTE_SEQUENCE = /:[A-Za-z0-9+/=]*:/y

/** Matches a sticky pattern at `i`; the index after the match, or -1. */
function skipPattern (pattern: RegExp, value: string, i: number): number {
  pattern.lastIndex = i
  return pattern.test(value) ? pattern.lastIndex : -1
}

/** §4.2.3.2: *( ";" *SP key [ "=" bare-item ] ). */
function skipParameters (value: string, i: number): number {
  while (i >= 0 && value.charCodeAt(i) === 0x3b) {
    i = skipPattern(PARAMETER_KEY, value, skipSpaces(value, i + 1))
    if (i >= 0 && value.charCodeAt(i) === 0x3d) i = skipBareItem(value, i + 1)
  }
  return i
}

/** §4.2.3.1, dispatching on the first character. */
function skipBareItem (value: string, i: number): number {
  const c = value.charCodeAt(i)
  if (c === 0x2d || (c >= 0x30 && c <= 0x39)) return skipNumber(value, i, true)
  if (c === 0x22) return skipString(value, i)
  if (c === 0x3a) return skipPattern(BYTE_SEQUENCE, value, i) // base64 content: ignored, so not decoded (§4.2.7 lets parsers be lenient)
  if (c === 0x3f) return value[i + 1] === '0' || value[i + 1] === '1' ? i + 2 : -1
  if (c === 0x40) return skipNumber(value, i + 1, false) // a Date is an Integer (§4.2.9)
  if (c === 0x25) return skipDisplayString(value, i)
  return skipPattern(TOKEN, value, i)
}

/** §4.2.4: ["-"] 1*15DIGIT, or ["-"] 1*12DIGIT "." 1*3DIGIT when a Decimal is allowed. */
function skipNumber (value: string, i: number, decimal: boolean): number {
  if (value.charCodeAt(i) === 0x2d) i++
  let whole = 0
  let fraction = -1
  for (; i < value.length; i++) {
    const c = value.charCodeAt(i)
    if (c >= 0x30 && c <= 0x39) {
      if (fraction < 0) whole++
      else fraction++
    } else if (c === 0x2e && fraction < 0 && decimal && whole <= 12) {
      fraction = 0
    } else {
      break
    }
  }
  if (whole === 0 || whole > 15 || fraction === 0 || fraction > 3) return -1
  // A "." after a Date or after 13 digits is a parse failure, not the end of the number.
  return value.charCodeAt(i) === 0x2e && fraction < 0 ? -1 : i
}

/** §4.2.10: `%"`, VCHAR or SP with `%` + two lower-case hex digits, `"`; the bytes must be UTF-8. */
function skipDisplayString (value: string, i: number): number {
  if (value.charCodeAt(i + 1) !== 0x22) return -1
  const bytes: number[] = []
  for (i += 2; i < value.length; i++) {
    const c = value.charCodeAt(i)
    if (c < 0x20 || c > 0x7e) return -1
    if (c === 0x22) return isUtf8(Uint8Array.from(bytes)) ? i + 1 : -1
    if (c === 0x25) {
      const hex = value.slice(i + 1, i + 3)
      if (!/^[0-9a-f]{2}$/.test(hex)) return -1
      bytes.push(parseInt(hex, 16))
      i += 2
    } else {
      bytes.push(c)
    }
  }
  return -1
}

function readBareValue (value: string): string | ParsedKey {
  for (let i = 0; i < value.length; i++) {
    const c = value.charCodeAt(i)
    // Visible ASCII (RFC 5234 VCHAR) minus quotes (" and ') and ",".
    if (c < 0x21 || c > 0x7e || c === 0x22 || c === 0x27 || c === 0x2c) {
      return invalid('The Idempotency-Key must be visible ASCII without spaces, quotes or commas, or a quoted Structured Field string.')
    }
  }
  return value
}
