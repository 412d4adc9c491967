import { parseHttpDate } from './http-date.js'

/**
 * Exponential backoff with full jitter: uniform in [0, min(maxMs, baseMs × 2^(retry - 1))). Spreading
 * retries over the whole interval keeps clients that failed together from coming back together.
 */
export function backoffDelay (retry: number, baseMs: number, maxMs: number, random: () => number): number {
  const cap = Math.min(maxMs, baseMs * 2 ** (retry - 1))
  return Math.floor(random() * cap)
}

/**
 * `Retry-After` (RFC 9110 §10.2.3) in milliseconds: delay-seconds, or an HTTP-date (§5.6.7, the
 * obsolete forms included), measured against the response's own `Date` when it has one, so that a
 * skewed client clock does not stretch or cut the wait. `null` when absent or malformed.
 */
export function retryAfterMs (headers: Headers, wallClock: () => number = Date.now): number | null {
  const value = headers.get('retry-after')?.trim()
  if (value === undefined || value === '') return null
  if (/^\d+$/.test(value)) return Number(value) * 1000
  const at = parseHttpDate(value, wallClock)
  if (at === null) return null
  const sent = parseHttpDate(headers.get('date') ?? '', wallClock) ?? wallClock()
  return Math.max(0, at - sent)
}
