/**
 * Raised when Redis did not answer within the pre-filter's `timeout`. The core treats it like any
 * pre-filter failure: as a miss, falling through to the store (fail open to the source of truth).
 */
export class PrefilterTimeoutError extends Error {
  readonly code = 'FST_IDEMPOTENCY_PREFILTER_TIMEOUT'

  constructor (operation: string, ms: number) {
    super(`fastify-idempotency: redis pre-filter ${operation}() did not answer within ${ms} ms`)
    this.name = 'PrefilterTimeoutError'
  }
}

/** Raised by an operation called (or still pending) after `close()`. */
export class PrefilterClosedError extends Error {
  readonly code = 'FST_IDEMPOTENCY_PREFILTER_CLOSED'

  constructor (operation: string) {
    super(`fastify-idempotency: redis pre-filter ${operation}() called after close()`)
    this.name = 'PrefilterClosedError'
  }
}
