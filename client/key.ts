import { InvalidOptionError } from './errors.js'

/**
 * Methods that are idempotent by definition (RFC 9110 §9.2.2): retrying them is safe without a key.
 * Every other method (POST, PATCH, extension methods) gets a key per logical operation, so that a
 * retry after an unknown outcome cannot execute it twice (draft §1, §2.2).
 */
const IDEMPOTENT_METHODS = new Set(['GET', 'HEAD', 'OPTIONS', 'TRACE', 'PUT', 'DELETE'])

export function methodNeedsKey (method: string): boolean {
  return !IDEMPOTENT_METHODS.has(method)
}

/** A UUID v4, the random identifier the draft recommends (§2.2). */
export function generateKey (): string {
  return globalThis.crypto.randomUUID()
}

/**
 * The key as an sf-string (RFC 9651 §3.3.3), the only form draft §2.1 allows: printable ASCII,
 * `"` and `\` escaped. A server in strict mode refuses a bare token.
 */
export function serializeKey (key: string): string {
  return `"${key.replace(/["\\]/g, '\\$&')}"`
}

export function checkKey (key: unknown): string {
  // sf-strings hold printable ASCII only (RFC 9651 §3.3.3); 8192 is the plugin's largest maxKeyLength.
  if (typeof key !== 'string' || key.length === 0 || key.length > 8192 || !/^[\x20-\x7e]+$/.test(key)) {
    throw new InvalidOptionError('key', 'a non-empty string of printable ASCII (at most 8192 characters)', key)
  }
  return key
}
