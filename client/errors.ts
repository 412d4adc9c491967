import { describeValue } from './describe-value.js'

/**
 * Thrown by `createIdempotentClient` (or a request) for an option that cannot work, before anything
 * is sent. It names the option and describes the value received by its kind, never its content
 * (describe-value.ts: a base URL or a header value may hold a credential); nothing falls back
 * silently.
 */
export class InvalidOptionError extends TypeError {
  readonly code = 'IDEMPOTENCY_CLIENT_INVALID_OPTION'
  readonly option: string
  /** The value refused; not enumerable, so that a logger serializing the error does not write it out. */
  declare readonly received: unknown

  constructor (option: string, expectation: string, received: unknown) {
    super(`fastify-idempotency/client: ${option} must be ${expectation}; received ${describeValue(received)}`)
    this.name = 'InvalidOptionError'
    this.option = option
    Object.defineProperty(this, 'received', { value: received, enumerable: false, writable: false, configurable: true })
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

/**
 * An answer arrived, but its body exceeded `maxResponseBytes`: the read was given up (before the
 * first byte when `Content-Length` said so) and the connection closed. The server did answer, so
 * this is not an unknown outcome: `status` says what it was (a 2xx means the operation ran). It is
 * not retried: a replay of a recorded answer is the same answer, as large, so asking again with the
 * same limit fails the same way. To read it, ask again with `key: error.key` from a client with a
 * larger `maxResponseBytes`; the server replays the recorded answer instead of running the operation
 * again (draft §2.6).
 */
export class ResponseTooLargeError extends Error {
  readonly code = 'IDEMPOTENCY_CLIENT_RESPONSE_TOO_LARGE'
  /** The key every attempt carried, or `null` for an idempotent method sent without one. */
  readonly key: string | null
  readonly attempts: number
  /** The answer's status and headers, as received; its body was not kept. */
  readonly status: number
  readonly headers: Headers
  /** `Idempotent-Replayed: true`: the answer is the record of an earlier execution. */
  readonly replayed: boolean
  /** The `maxResponseBytes` in force. */
  readonly limit: number
  /** The `Content-Length` that announced more than `limit`, or `null` when the excess was counted. */
  readonly declaredBytes: number | null
  /** Bytes read before the read was given up: 0 when `Content-Length` said enough; at most `limit` plus one chunk. */
  readonly receivedBytes: number

  constructor (what: string, details: {
    key: string | null,
    attempts: number,
    status: number,
    headers: Headers,
    replayed: boolean,
    limit: number,
    declaredBytes: number | null,
    receivedBytes: number
  }) {
    const size = details.declaredBytes !== null ? `Content-Length ${details.declaredBytes}` : `more than ${details.limit} bytes arrived`
    super(`fastify-idempotency/client: the ${details.status} answer to ${what} exceeds maxResponseBytes (${details.limit}): ${size}`)
    this.name = 'ResponseTooLargeError'
    this.key = details.key
    this.attempts = details.attempts
    this.status = details.status
    this.headers = details.headers
    this.replayed = details.replayed
    this.limit = details.limit
    this.declaredBytes = details.declaredBytes
    this.receivedBytes = details.receivedBytes
  }
}
