import { inspect } from 'node:util'

/** Thrown at registration (or when a route is added) for an option that cannot work. */
export class InvalidOptionError extends TypeError {
  readonly code = 'FST_IDEMPOTENCY_INVALID_OPTION'
  readonly option: string
  readonly received: unknown

  constructor (option: string, expectation: string, received: unknown) {
    super(`fastify-idempotency: ${option} must be ${expectation}; received ${describe(received)}`)
    this.name = 'InvalidOptionError'
    this.option = option
    this.received = received
  }
}

function describe (value: unknown): string {
  const shown = inspect(value, { depth: 1, breakLength: Infinity, maxStringLength: 80 })
  return value === null || value === undefined ? shown : `${shown} (${Array.isArray(value) ? 'array' : typeof value})`
}

/** Raised by a store operation that did not answer within `storeTimeout`. */
export class StoreTimeoutError extends Error {
  readonly code = 'FST_IDEMPOTENCY_STORE_TIMEOUT'

  constructor (operation: string, ms: number) {
    super(`fastify-idempotency: store.${operation}() did not answer within ${ms} ms`)
    this.name = 'StoreTimeoutError'
  }
}

/**
 * Raised by `request.idempotency.step()` when the request no longer owns its key (its lease lapsed
 * and another attempt took the key over, or an operator force-released it): the step did not run
 * (or, if it ran before the key was lost, was not recorded), and the handler must stop, since the
 * key's current owner continues the operation.
 */
export class LeaseLostError extends Error {
  readonly code = 'FST_IDEMPOTENCY_LEASE_LOST'

  constructor (step: string) {
    super(`fastify-idempotency: step "${step}" was not recorded: this request no longer owns its Idempotency-Key (another attempt took it over, or it was force-released)`)
    this.name = 'LeaseLostError'
  }
}

/**
 * Thrown by a transactional store's `complete` (atomic mode) when the database reported that the
 * transaction did not commit and was rolled back: nothing of the operation happened. Any other
 * error from that `complete` leaves the outcome unknown (the connection dropped after COMMIT was
 * sent, a timeout), and the plugin never claims a rollback it did not see.
 */
export class RolledBackError extends Error {
  readonly code = 'FST_IDEMPOTENCY_ROLLED_BACK'

  constructor (reason: string, options?: { cause?: unknown }) {
    super(`fastify-idempotency: ${reason}`, options)
    this.name = 'RolledBackError'
  }
}
