import { InvalidOptionError } from './errors.js'
import type { RedirectMode } from './redirect.js'

/** The subset of the global `fetch` the client calls; inject one for tests or a custom agent. */
export type FetchLike = (input: string, init: RequestInit) => Promise<Response>

/** Waits `ms` milliseconds; rejects with `signal.reason` if the caller aborts meanwhile. */
export type Sleep = (ms: number, signal?: AbortSignal) => Promise<void>

export interface BackoffOptions {
  /**
   * Cap of the first retry's delay; the cap doubles on each retry (exponential backoff, full jitter:
   * the delay is uniform between 0 and the cap).
   * @defaultValue 500
   */
  readonly baseMs?: number
  /**
   * Largest cap: no backoff delay exceeds it (a server's `Retry-After` may ask for longer).
   * @defaultValue 8_000
   */
  readonly maxMs?: number
}

export interface IdempotentClientOptions {
  /** Resolves request paths (`/payments`); without it every request needs an absolute http(s) URL. */
  readonly baseUrl?: string | URL
  /**
   * Attempts per logical operation, the first included.
   * @defaultValue 5
   */
  readonly maxAttempts?: number
  /**
   * Milliseconds one attempt may take, until its whole response body has arrived; then it is
   * aborted and retried with the same key.
   * @defaultValue 30_000
   */
  readonly timeoutMs?: number
  /**
   * Milliseconds the whole operation may take, waits included: no attempt starts or goes on past it.
   * @defaultValue 120_000
   */
  readonly deadlineMs?: number
  readonly backoff?: BackoffOptions
  /**
   * Statuses retried with the same key (besides network errors and timeouts), unless the answer is
   * a replay (`Idempotent-Replayed: true`): a recorded outcome is final. Only 408, 409, 425, 429 and
   * 5xx are allowed: after any other 4xx the request must be corrected first (draft §2.7).
   * @defaultValue [409, 503]
   */
  readonly retryStatuses?: readonly number[]
  /** Headers sent with every request (a request's own headers override them). */
  readonly headers?: Readonly<Record<string, string>>
  /**
   * `'manual'`: a 3xx is the answer, returned with its `Location`, never followed. `'same-origin'`:
   * redirects to the request's own origin are followed (at most 5 hops; a 303, or a 301/302 to a
   * POST, becomes a GET without the body and without the key); one to another origin is returned as
   * the answer. Nothing (body, key, `headers`) is ever sent to an origin the caller did not name.
   * @defaultValue 'manual'
   */
  readonly redirect?: RedirectMode
  /**
   * Largest response body read, in bytes. A `Content-Length` over it is refused before reading; a
   * longer body is cut off as it arrives and the connection closed; the call rejects with
   * `ResponseTooLargeError` (the status, headers and key; not retried).
   * @defaultValue 8_388_608 (8 MiB)
   */
  readonly maxResponseBytes?: number
  /** @defaultValue the global `fetch` */
  readonly fetch?: FetchLike
  /** Uniform in [0, 1): the backoff jitter. @defaultValue `Math.random` */
  readonly random?: () => number
  /** @defaultValue a `setTimeout` that the request's `signal` cancels */
  readonly sleep?: Sleep
  /** A monotonic clock in ms, for the deadline. @defaultValue `performance.now` */
  readonly now?: () => number
}

export interface ResolvedClientOptions {
  readonly baseUrl: URL | null
  readonly maxAttempts: number
  readonly timeoutMs: number
  readonly deadlineMs: number
  readonly backoffBaseMs: number
  readonly backoffMaxMs: number
  readonly retryStatuses: ReadonlySet<number>
  readonly headers: Readonly<Record<string, string>>
  readonly redirect: RedirectMode
  readonly maxResponseBytes: number
  readonly fetch: FetchLike
  readonly random: () => number
  readonly sleep: Sleep
  readonly now: () => number
}

/** setTimeout's ceiling: a longer delay fires at once. */
const MAX_TIMER_MS = 2_147_483_647

/**
 * 8× the plugin's own default `maxResponseBytes` (1 MiB): an answer the server can replay fits with
 * room to spare, while one call cannot make the client hold more than a few MiB.
 */
const DEFAULT_MAX_RESPONSE_BYTES = 8 * 1024 * 1024

/** 2 GiB − 1: the largest single buffer every JavaScript engine the client runs on can allocate. */
const MAX_RESPONSE_BYTES = 2_147_483_647

const KNOWN = new Set([
  'baseUrl', 'maxAttempts', 'timeoutMs', 'deadlineMs', 'backoff', 'retryStatuses', 'headers', 'redirect', 'maxResponseBytes',
  'fetch', 'random', 'sleep', 'now'
])

export function resolveClientOptions (options: IdempotentClientOptions = {}): ResolvedClientOptions {
  if (typeof options !== 'object' || options === null) throw new InvalidOptionError('options', 'an object', options)
  for (const name of Object.keys(options)) {
    if (!KNOWN.has(name)) throw new InvalidOptionError(name, `one of the known options (${[...KNOWN].join(', ')})`, (options as Record<string, unknown>)[name])
  }
  const backoff = options.backoff ?? {}
  if (typeof backoff !== 'object' || backoff === null) throw new InvalidOptionError('backoff', 'an object { baseMs, maxMs }', backoff)
  const backoffBaseMs = integer('backoff.baseMs', backoff.baseMs, 500, 0, MAX_TIMER_MS)
  const backoffMaxMs = integer('backoff.maxMs', backoff.maxMs, Math.max(8_000, backoffBaseMs), backoffBaseMs, MAX_TIMER_MS)
  return {
    baseUrl: baseUrl(options.baseUrl),
    maxAttempts: integer('maxAttempts', options.maxAttempts, 5, 1, 100),
    timeoutMs: integer('timeoutMs', options.timeoutMs, 30_000, 1, MAX_TIMER_MS),
    deadlineMs: integer('deadlineMs', options.deadlineMs, 120_000, 1, MAX_TIMER_MS),
    backoffBaseMs,
    backoffMaxMs,
    retryStatuses: retryStatuses(options.retryStatuses),
    headers: headerRecord('headers', options.headers),
    redirect: redirect(options.redirect),
    maxResponseBytes: integer('maxResponseBytes', options.maxResponseBytes, DEFAULT_MAX_RESPONSE_BYTES, 0, MAX_RESPONSE_BYTES),
    fetch: fn('fetch', options.fetch) ?? ((input, init) => fetch(input, init)),
    random: fn('random', options.random) ?? Math.random,
    sleep: fn('sleep', options.sleep) ?? sleep,
    now: fn('now', options.now) ?? (() => performance.now())
  }
}

function integer (name: string, value: unknown, fallback: number, min: number, max: number): number {
  if (value === undefined) return fallback
  if (typeof value !== 'number' || !Number.isInteger(value) || value < min || value > max) {
    throw new InvalidOptionError(name, `an integer from ${min} to ${max}`, value)
  }
  return value
}

function baseUrl (value: unknown): URL | null {
  if (value === undefined) return null
  const url = typeof value === 'string' && URL.canParse(value) ? new URL(value) : value instanceof URL ? new URL(value.href) : null
  if (url === null || (url.protocol !== 'http:' && url.protocol !== 'https:')) {
    throw new InvalidOptionError('baseUrl', 'an absolute http(s) URL', value)
  }
  // Without a trailing slash, `new URL('payments', 'https://api.example.com/v1')` would drop `v1`.
  if (!url.pathname.endsWith('/')) url.pathname += '/'
  return url
}

function redirect (value: unknown): RedirectMode {
  if (value === undefined) return 'manual'
  if (value === 'manual' || value === 'same-origin') return value
  // 'follow' (fetch's default) is refused by name: it is what sends the body, the key and the
  // credentials to whichever origin a Location names.
  throw new InvalidOptionError('redirect', '\'manual\' or \'same-origin\' (fetch\'s \'follow\' would send the body, key and headers to any origin)', value)
}

function retryStatuses (value: unknown): ReadonlySet<number> {
  if (value === undefined) return new Set([409, 503])
  const expectation = 'an array of statuses among 408, 409, 425, 429 and 500 to 599'
  if (!Array.isArray(value)) throw new InvalidOptionError('retryStatuses', expectation, value)
  for (const status of value) {
    if (typeof status !== 'number' || !Number.isInteger(status) ||
      !(status === 408 || status === 409 || status === 425 || status === 429 || (status >= 500 && status <= 599))) {
      throw new InvalidOptionError('retryStatuses', expectation, value)
    }
  }
  return new Set(value as number[])
}

/** Request headers as a record of strings, checked by `Headers` itself (names and values). */
export function headerRecord (name: string, value: unknown): Readonly<Record<string, string>> {
  if (value === undefined) return {}
  if (typeof value !== 'object' || value === null || Array.isArray(value) || value instanceof Headers) {
    throw new InvalidOptionError(name, 'a record of header names to string values', value)
  }
  const record: Record<string, string> = {}
  for (const [field, fieldValue] of Object.entries(value)) {
    if (typeof fieldValue !== 'string') throw new InvalidOptionError(`${name}[${JSON.stringify(field)}]`, 'a string', fieldValue)
    try {
      // Constructed only for its validation: Headers throws on an invalid name or value.
      new Headers([[field, fieldValue]]) // eslint-disable-line no-new
    } catch {
      throw new InvalidOptionError(`${name}[${JSON.stringify(field)}]`, 'a valid header name and value', fieldValue)
    }
    if (field.toLowerCase() === 'idempotency-key') {
      throw new InvalidOptionError(`${name}["idempotency-key"]`, 'absent (pass the key as the `key` request option)', fieldValue)
    }
    record[field.toLowerCase()] = fieldValue
  }
  return record
}

function fn<T> (name: string, value: T | undefined): T | undefined {
  if (value !== undefined && typeof value !== 'function') throw new InvalidOptionError(name, 'a function', value)
  return value
}

function sleep (ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted === true) { reject(signal.reason); return }
    const onAbort = (): void => { clearTimeout(timer); reject(signal?.reason) }
    const timer = setTimeout(() => { signal?.removeEventListener('abort', onAbort); resolve() }, ms)
    signal?.addEventListener('abort', onAbort, { once: true })
  })
}
