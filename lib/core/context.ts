import { Lifecycle } from './lifecycle.js'
import type { Logger, Observed } from './observe.js'
import type { CoreSettings } from './settings.js'
import type { Fingerprint, OutboxEntry, RecordId } from './store.js'

/** What a protected request exposes as `request.idempotency`. */
export interface IdempotencyContext {
  /** The key as the client meant it (an sf-string's value, without quotes or escapes). */
  readonly key: string
  /** The principal that owns the key. */
  readonly scope: string
  readonly fingerprint: Fingerprint
  /** True when this request was answered from the record instead of running the handler. */
  readonly replayed: boolean

  /**
   * Set it (to a JSON value, e.g. `{ type: 'payment', id }`) on a route with a `rebuild` option to
   * record this reference instead of the response body; replays then call `rebuild(reference)`.
   */
  reference: unknown

  /**
   * The idempotency key for a downstream call named `name` (a provider's charge, an email): the
   * same on every attempt of this operation (retries, takeovers, the reconciler), different for
   * every other (scope, key, name). Pass it as the provider's own idempotency key.
   */
  deriveKey (name: string): string

  /**
   * A recovery point: runs `fn` at most once per (scope, key, name) and records its result (as JSON:
   * the value `JSON.parse(JSON.stringify(result))`, which is also what the first run returns). When
   * an attempt crashed or failed after the step completed, the next attempt gets the recorded result
   * without running `fn` again and continues from the first incomplete step. Steps of one request
   * run one after another, in call order. Lease mode only, with a store that records steps (memory,
   * Postgres). Before `fn` runs, a fenced store call proves that this request still owns its key
   * (and extends its lease): a request whose key was taken over or force-released never runs `fn`,
   * it throws LeaseLostError instead. The one window left is a crash between `fn`'s effect and its
   * record: the next attempt runs `fn` again, which is what `deriveKey(name)` is for.
   */
  step<T> (name: string, fn: () => T | Promise<T>): Promise<T>

  /**
   * Declares this request's failure indeterminate: an external effect may have happened. The key
   * then stays in progress, with its recorded steps, and retries get 409 until the reconciler
   * resolves it (`store.reconcile`). The default once a step completed. Lease mode only: in atomic
   * mode the transaction is the unit of recovery, and a failure rolls it back with the claim (the
   * key is released), so call external services through steps of a lease-mode route or job.
   */
  markIndeterminate (): void

  /**
   * Declares this request's failure definite: nothing happened, so the key is released and a retry
   * runs the operation again from the start (recorded steps are discarded). The default when no
   * step completed.
   */
  markDefinite (): void

  /**
   * Transactional outbox (Postgres store with an `outbox` option): inserts `message` through
   * `transaction` (default: this request's, in atomic mode; in lease mode pass the one a
   * `step(name, fn, { transaction: true })` gives `fn`), so it exists exactly when that commits. It is
   * delivered after the commit with the key `deriveKey(message.name)`; the store's worker delivers
   * what a crash left behind.
   */
  enqueue (message: OutboxEntry, transaction?: unknown): Promise<void>
}

/** The operation's view as the core and the adapters use it: what they set on it besides what it exposes. */
export interface OperationContext extends IdempotencyContext {
  replayed: boolean
  /** Atomic mode: the open transaction (typed by the Postgres entry point's augmentation). */
  sql?: any
}

/**
 * What the core knows of one attempt to run an operation under a key: an HTTP request (the Fastify
 * adapter's subclass, lib/fastify/request-state.ts) or a job's run (lib/jobs/runner.ts). Every
 * step of the protocol (claim, lifecycle, outcome, steps) works on this and nothing else.
 */
export abstract class RequestState implements Observed {
  scope = ''
  /**
   * The request's unkeyed fingerprint (lib/core/fingerprint-keys.ts): with `encryption` it is never
   * stored, and is kept here to recompute the request's fingerprint under an older key.
   */
  unkeyedFingerprint: Fingerprint | null = null
  /** The claim took a record's fingerprint made under an older key (at most once per request). */
  adoptedFingerprint = false
  /** The phase, the lease's renewal and the key's fate: changed only through it (lib/core/lifecycle.ts). */
  readonly lifecycle: Lifecycle = new Lifecycle(this)
  /** (scope, key) as one object, for the pre-filter's calls. */
  recordId: RecordId | null = null
  /** The pre-filter holds this request's in-flight marker (set by its first lookup). */
  markedInFlight = false
  /** The operation's view (`request.idempotency`, a job's `op`), once the claim has its fingerprint (lib/core/recovery.ts). */
  context: OperationContext | null = null
  /** Recorded step results, loaded from the store at the first step() call. */
  steps: Record<string, unknown> | null = null
  /** A message was enqueued in the transaction now open: deliver after it commits. */
  enqueued = false
  /** The last step() call, so the next one runs after it settles (steps run in order). */
  stepChain: Promise<unknown> | null = null
  /**
   * How long the client is willing to wait for an original in flight, in ms (HTTP's `Prefer:
   * wait`), or null: the route's `wait` applies. Never more than the route's `wait`.
   */
  preferredWait: number | null = null
  /** performance.now() when the request reached the plugin: decision latencies are measured from it. */
  readonly startedAt = performance.now()

  constructor (
    /** Set once: when a route's `key` option gives it, in the claim (lib/fastify/hooks.ts). */
    public key: string,
    readonly settings: CoreSettings
  ) {}

  abstract readonly log: Logger
  /** The HTTP method, or `RUN` for a job. */
  abstract readonly method: string
  /** A bounded name for metrics: the route's path pattern, or the job's operation. */
  abstract readonly route: string
  /** The Fastify request, for diagnostics subscribers; undefined for a job. */
  abstract readonly request: unknown
}
