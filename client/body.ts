import { InvalidOptionError } from './errors.js'

/**
 * A request body the client can send again on every attempt: text, bytes, form fields, or a value
 * sent as JSON. One-shot streams are refused: a retry could not resend what the first attempt used up.
 */
export type RequestBody =
  | string
  | Uint8Array
  | ArrayBuffer
  | URLSearchParams
  | JsonValue

export type JsonValue = null | boolean | number | string | readonly JsonValue[] | { readonly [member: string]: JsonValue | undefined }

export interface EncodedBody {
  readonly bytes: Uint8Array | string | URLSearchParams
  /** The content type implied by the body's kind, used when the caller sets none. */
  readonly contentType: string | null
}

/**
 * Encodes the body once, before the first attempt: every attempt sends the same bytes, so a
 * server's fingerprint (draft §2.4) sees the same request each time.
 */
export function encodeBody (body: unknown): EncodedBody | null {
  if (body === undefined) return null
  if (typeof body === 'string') return { bytes: body, contentType: 'text/plain;charset=UTF-8' }
  if (body instanceof Uint8Array) return { bytes: body, contentType: 'application/octet-stream' }
  if (body instanceof ArrayBuffer) return { bytes: new Uint8Array(body), contentType: 'application/octet-stream' }
  if (body instanceof URLSearchParams) return { bytes: new URLSearchParams(body), contentType: 'application/x-www-form-urlencoded;charset=UTF-8' }
  if (isJson(body)) return { bytes: JSON.stringify(body), contentType: 'application/json' }
  throw new InvalidOptionError('body',
    'a string, Uint8Array/Buffer, ArrayBuffer, URLSearchParams or a JSON value (plain object, array, number, boolean, null); ' +
    'not a stream, which a retry could not send again', body)
}

function isJson (value: unknown): boolean {
  if (value === null || typeof value === 'boolean') return true
  if (typeof value === 'number') return Number.isFinite(value)
  if (typeof value !== 'object') return false
  if (Array.isArray(value)) return true
  const proto: unknown = Object.getPrototypeOf(value)
  return proto === Object.prototype || proto === null
}
