/**
 * Thrown by `createIdempotentClient` (or a request) for an option that cannot work, before anything
 * is sent. It names the option and the value received; nothing falls back silently.
 */
export class InvalidOptionError extends TypeError {
  readonly code = 'IDEMPOTENCY_CLIENT_INVALID_OPTION'
  readonly option: string
  readonly received: unknown

  constructor (option: string, expectation: string, received: unknown) {
    super(`fastify-idempotency/client: ${option} must be ${expectation}; received ${describe(received)}`)
    this.name = 'InvalidOptionError'
    this.option = option
    this.received = received
  }
}

/**
 * No HTTP answer was obtained: every attempt failed with a network error or a timeout, or the
 * deadline ran out. The outcome is unknown (an attempt may have executed), so the error carries the
 * key: retrying later with `key: error.key` cannot run the operation twice while the server still
 * holds the record (draft-ietf-httpapi-idempotency-key-header §2.3).
 */
export class NoAnswerError extends Error {
  readonly code = 'IDEMPOTENCY_CLIENT_NO_ANSWER'
  /** The key every attempt carried, or `null` for an idempotent method sent without one. */
  readonly key: string | null
  readonly attempts: number
  /** What stopped the retries: `maxAttempts` reached, or the overall `deadlineMs`. */
  readonly reason: 'attempts' | 'deadline'

  constructor (what: string, key: string | null, attempts: number, reason: 'attempts' | 'deadline', cause: unknown) {
    const why = reason === 'attempts' ? `after ${attempts} attempt${attempts === 1 ? '' : 's'}` : `within the deadline (${attempts} attempt${attempts === 1 ? '' : 's'})`
    super(`fastify-idempotency/client: no answer to ${what} ${why}: ${cause instanceof Error ? cause.message : String(cause)}`, { cause })
    this.name = 'NoAnswerError'
    this.key = key
    this.attempts = attempts
    this.reason = reason
  }
}

function describe (value: unknown): string {
  if (value === null || value === undefined) return String(value)
  let shown: string
  if (typeof value === 'string') shown = JSON.stringify(value.length > 80 ? `${value.slice(0, 80)}...` : value)
  else if (typeof value === 'function') shown = `[Function ${value.name === '' ? '(anonymous)' : value.name}]`
  else if (typeof value === 'object') shown = (isPlain(value) ? json(value) : undefined) ?? `[object ${value.constructor?.name ?? 'Object'}]`
  else shown = String(value)
  return `${shown} (${Array.isArray(value) ? 'array' : typeof value})`
}

function isPlain (value: object): boolean {
  const proto: unknown = Object.getPrototypeOf(value)
  return Array.isArray(value) || proto === Object.prototype || proto === null
}

function json (value: object): string | undefined {
  try {
    const text = JSON.stringify(value)
    return text === undefined || text.length > 120 ? undefined : text
  } catch {
    return undefined
  }
}
