/**
 * What the protocol needs to know of a route or a job's run, decided once (the route) or per run
 * (a job). The HTTP surface's RouteSettings (lib/http/options.ts) adds what only a route has.
 */
export interface CoreSettings {
  /** How long a record is kept after it was completed, in ms. */
  readonly ttl: number
  /** How long an in-progress key stays with its owner without a renewal, in ms. */
  readonly lease: number
  /** The longest a live owner keeps renewing its lease, in ms; 0 for no bound. */
  readonly maxOwnership: number
  /** How long a duplicate waits for an in-flight original, in ms. */
  readonly wait: number
  /** The bound on every store call, in ms. */
  readonly storeTimeout: number
  /** Retry-After of a refusal, in seconds. */
  readonly retryAfter: number
  /** What a store failure does: refuse (503 / an error), or run without protection. */
  readonly onStoreError: 'fail' | 'bypass'
  /** Atomic mode: the claim, the operation's writes and the record share one transaction. */
  readonly transaction: boolean
}
