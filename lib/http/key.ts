import type { FastifyRequest } from 'fastify'
import { parseItem, ParseError } from 'structured-headers'
import { describeValue } from '../../client/describe-value.js'

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
  // parameters, surrounding spaces, every malformed value) goes through the full RFC 9651 parser.
  const last = value.length - 1
  if (last > 0 && value.charCodeAt(0) === 0x22 && value.charCodeAt(last) === 0x22) {
    let simple = true
    for (let i = 1; i < last; i++) {
      const c = value.charCodeAt(i)
      if (c < 0x20 || c > 0x7e || c === 0x22 || c === 0x5c) { simple = false; break }
    }
    if (simple) return value.slice(1, last)
  }
  let bare
  try {
    bare = parseItem(value)[0]
  } catch (err) {
    if (err instanceof ParseError) return invalid('The Idempotency-Key must be a Structured Field string, such as "8e03978e-40d5-43e8-bc93-6894a57f9324".')
    throw err
  }
  if (typeof bare !== 'string') return invalid('The Idempotency-Key must be a string (a quoted value), not another Structured Field type.')
  return bare
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

/** A route's `key` option: the key from elsewhere in the request (a webhook's event id), or undefined. */
export type KeyFunction = (request: FastifyRequest) => string | undefined

const NO_KEY_FROM_FUNCTION: ParsedKey = { ok: false, reason: 'missing', detail: 'This operation requires a key, and the request carries none where this route looks for it.' }

/** C0 and C1 controls and DEL (Unicode Cc), and a surrogate that is not half of a pair. */
const UNSTORABLE = /[\p{Cc}\p{Cs}]/u

/**
 * The key a route's `key` function returns, taken verbatim: it is the sender's identifier (an event
 * id, a delivery id), not a Structured Field, so nothing is unquoted. Control characters are refused
 * (no driver can store a NUL, and a key is logged), and so is a lone surrogate (a body's `"\ud800"`):
 * UTF-8 cannot encode it, so PostgreSQL would store U+FFFD and two different keys would become one.
 * Anything longer than `maxLength` is refused too.
 */
export function keyFromFunction (fn: KeyFunction, request: FastifyRequest, maxLength: number): ParsedKey {
  const key: unknown = fn(request)
  if (key === undefined) return NO_KEY_FROM_FUNCTION
  if (typeof key !== 'string') {
    throw new TypeError(`fastify-idempotency: the route's key function must return a string or undefined; it returned ${describeValue(key)}`)
  }
  if (key.length === 0) return invalid('The key must not be empty.')
  if (key.length > maxLength) return invalid(`The key must be at most ${maxLength} characters long.`)
  if (UNSTORABLE.test(key)) return invalid('The key must not contain control characters or unpaired surrogates.')
  return { ok: true, key }
}
