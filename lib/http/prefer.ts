/**
 * The `wait` preference (RFC 7240 §4.3): the time, in seconds, within which the client wants an
 * answer. Here it bounds how long a duplicate waits for its original: a client may ask for less
 * than the route's `wait` (0: an immediate 409) and never gets more.
 */

/** Longest preference read, in seconds: anything longer is longer than any route's `wait` anyway. */
const MAX_SECONDS = 2_147_483

/**
 * The request's `wait` preference in ms, or null when it states none or an unreadable one. Several
 * Prefer headers count as one list (RFC 9110 §5.3), and only the first `wait` counts (RFC 7240 §2:
 * a preference given more than once is taken from its first instance).
 */
export function preferredWait (header: string | string[] | undefined): number | null {
  if (header === undefined) return null
  const list = Array.isArray(header) ? header.join(',') : header
  for (const preference of list.split(',')) {
    const head = preference.split(';', 1)[0] as string
    const equals = head.indexOf('=')
    const name = (equals < 0 ? head : head.slice(0, equals)).trim().toLowerCase()
    if (name !== 'wait') continue
    let value = equals < 0 ? '' : head.slice(equals + 1).trim()
    // A value may be a token or a quoted-string (RFC 7240 §2).
    if (value.length >= 2 && value.startsWith('"') && value.endsWith('"')) value = value.slice(1, -1)
    if (!/^\d{1,10}$/.test(value)) return null
    return Math.min(Number(value), MAX_SECONDS) * 1000
  }
  return null
}

/** What `Preference-Applied` says of a `wait` preference: the wait applied, in whole seconds (delta-seconds), rounded down. */
export function appliedWait (preferredMs: number, routeWaitMs: number): string {
  return `wait=${Math.floor(Math.min(preferredMs, routeWaitMs) / 1000)}`
}
