import { describeValue } from '../../client/describe-value.js'

/**
 * Thrown at registration (or when a route is added) for an option that cannot work, by the plugin
 * and by every driver. The message names the option and describes the value by its kind
 * (`received a postgres.js client`, `received a string of 12 characters`; numbers and booleans as
 * they are), never by its content: option values carry credentials (a client's password, a
 * connection string, a key), and this message ends up in logs and crash reports.
 */
export class InvalidOptionError extends TypeError {
  readonly code = 'FST_IDEMPOTENCY_INVALID_OPTION'
  readonly option: string
  /**
   * The value refused, for code that handles the error. Not enumerable, so that a logger or crash
   * reporter that serializes the error's own properties (pino's, Sentry's) does not write it out.
   */
  declare readonly received: unknown

  /**
   * `description` replaces the described kind, for a value the package itself knows to be harmless
   * to show (a header name from its own lists, a key id it already validated).
   */
  constructor (option: string, expectation: string, received: unknown, description: string = describeValue(received)) {
    super(`fastify-idempotency: ${option} must be ${expectation}; received ${description}`)
    this.name = 'InvalidOptionError'
    this.option = option
    Object.defineProperty(this, 'received', { value: received, enumerable: false, writable: false, configurable: true })
  }
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

/**
 * Thrown by a transactional store's `complete` or `release` (atomic mode) when the transaction
 * holding the claim ended before the plugin ended it: the handler sent COMMIT, ROLLBACK or PREPARE
 * TRANSACTION (or a statement that ends the transaction) through `request.idempotency.sql`. What
 * the handler wrote may have committed without the recorded response, so the store fails closed:
 * it holds the key for the reconciler (`held`), never releasing it and never letting a retry take
 * it over, and the client gets a 500 problem (`transaction-ended`). `held` is false only when the
 * store could not write the hold (the database failed too); the record then stays as the claim
 * left it, which in atomic mode is itself held (a claim commits held until its response is written).
 */
export class TransactionEndedError extends Error {
  readonly code = 'FST_IDEMPOTENCY_TRANSACTION_ENDED'
  readonly held: boolean
  /** Set for a transactional step's transaction (`step(name, fn, { transaction: true })`): its name. */
  readonly step: string | null

  constructor (held: boolean, options?: { cause?: unknown, step?: string }) {
    const step = options?.step ?? null
    super(step === null
      ? `fastify-idempotency: the request's transaction was ended through request.idempotency.sql (COMMIT, ROLLBACK or PREPARE TRANSACTION) before its response was recorded; ${held ? 'the key is held for the reconciler' : 'the key could not be held'}`
      : `fastify-idempotency: the transaction of step "${step}" was ended through its handle before the step was recorded; what it wrote may have committed, so the request's failure is indeterminate (its key is held)`, { cause: options?.cause })
    this.name = 'TransactionEndedError'
    this.held = held
    this.step = step
  }
}

/**
 * Fails the boot (`ready()`, `listen()`) when routes for protected methods were declared before the
 * plugin loaded: Fastify's onRoute never showed them to it, so they would run unprotected.
 */
export class UnprotectedRoutesError extends Error {
  readonly code = 'FST_IDEMPOTENCY_UNPROTECTED_ROUTES'
  /** `METHOD /path` of each route. */
  readonly routes: readonly string[]

  constructor (routes: readonly string[]) {
    super(`fastify-idempotency: these routes were declared before the plugin finished loading, so they are NOT protected: ${routes.join('; ')}. ` +
      'Await app.register(idempotency, ...) before declaring them, or declare them in a plugin registered after it ' +
      "(or pass onEarlierRoutes: 'warn' if they are meant to run unprotected).")
    this.name = 'UnprotectedRoutesError'
    this.routes = routes
  }
}

/** Raised (a 500, logged) when the scope function returns '' and `allowEmptyScope` is not set. */
export class EmptyScopeError extends TypeError {
  readonly code = 'FST_IDEMPOTENCY_EMPTY_SCOPE'

  constructor () {
    super('fastify-idempotency: the scope function returned an empty string, which would put every such caller in one shared key space. ' +
      'Return the principal (tenant, account id), or pass allowEmptyScope: true if one shared scope for those callers is meant.')
    this.name = 'EmptyScopeError'
  }
}

/**
 * Fails the boot (`ready()`, `listen()`) when the store's own check (`IdempotencyStore.check`) found
 * that it cannot serve as it is set up: on PostgreSQL, its tables missing or created by an earlier
 * version. Without it every protected request would answer 503, and with Fastify's default
 * `logger: false` nothing would say why.
 */
export class StoreNotReadyError extends Error {
  readonly code = 'FST_IDEMPOTENCY_STORE_NOT_READY'

  constructor (message: string) {
    super(`fastify-idempotency: ${message}`)
    this.name = 'StoreNotReadyError'
  }
}

/**
 * A job's run refused because another run holds its key (draft §2.7's 409, for a job): the
 * original is still running, or crashed and its lease has not lapsed yet, or it failed in a way
 * that may have left an effect and waits for the reconciler. Nothing ran. Retry after `retryAfter`
 * ms (a queue's backoff does it): the retry gets the original's value once it completed.
 */
export class OperationInProgressError extends Error {
  readonly code = 'FST_IDEMPOTENCY_IN_PROGRESS'

  constructor (readonly retryAfter: number) {
    super(`fastify-idempotency: another run holds this key; retry in ${retryAfter} ms`)
    this.name = 'OperationInProgressError'
  }
}

/**
 * A job's run refused because its key was used for another operation or payload (draft §2.7's
 * 422, for a job): nothing ran. Retrying cannot succeed; a key reused with another payload is a
 * bug (or a forged delivery) worth an alert.
 */
export class KeyReusedError extends Error {
  readonly code = 'FST_IDEMPOTENCY_MISMATCH'

  constructor () {
    super('fastify-idempotency: this key was used with another operation or payload')
    this.name = 'KeyReusedError'
  }
}

/**
 * A job's run refused because the store failed or did not answer within `storeTimeout` (or holds a
 * record this process cannot verify): the operation did not run, unless `outcomeUnknown` says that
 * atomic mode's COMMIT was sent and no answer came back (a retry then replays the committed value
 * or runs afresh, whichever is true). Retry later. `cause` is the store's error.
 */
export class StoreUnavailableError extends Error {
  readonly code = 'FST_IDEMPOTENCY_STORE_UNAVAILABLE'

  constructor (message: string, readonly outcomeUnknown: boolean, cause?: unknown) {
    super(`fastify-idempotency: ${message}`, cause === undefined ? undefined : { cause })
    this.name = 'StoreUnavailableError'
  }
}
