import type { EvidenceLine } from './evidence.js'
import type { Scenario } from './scenario-routes.js'

/**
 * What a chaos run observed, in the shape the checker reads. Everything is plain data (JSON), so a
 * history can be saved, replayed through the checker, or written by hand to plant a violation.
 */

/** atomic: the effect is a ledger row written through the claim's transaction; lease: a provider charge. */
export type Mode = 'atomic' | 'lease'

/** One logical operation: one key, one body, retried by its client until it gets an answer. */
export interface Operation {
  readonly id: number
  readonly scope: string
  readonly key: string
  readonly mode: Mode
  readonly amount: number
  /**
   * A second body sent later under the same key by a misbehaving client (draft §2.4): it must be
   * refused with 422 and never have an effect.
   */
  readonly reuseAmount: number | null
  /** A lease-boundary situation (scenario-routes.ts), or null for the ordinary payments. */
  readonly scenario: Scenario | null
  /** queue: a job run by the workers through the job runner (queue.ts); absent: an HTTP operation. */
  readonly door?: 'http' | 'queue'
}

/** How one HTTP attempt ended. */
export type AttemptOutcome =
  | { readonly kind: 'response', readonly status: number, readonly replayed: boolean, readonly body: string, readonly retryAfter: number | null }
  | { readonly kind: 'error', readonly error: string }

export interface Attempt {
  readonly op: number
  /** The different body of the key-reuse client, or the operation's own. */
  readonly reuse: boolean
  /** 'load' while faults are injected; 'drain' for the retries after they stopped. */
  readonly phase: 'load' | 'drain'
  readonly instance: number
  /** Milliseconds since the run started. */
  readonly startedAt: number
  readonly endedAt: number
  readonly outcome: AttemptOutcome
  /** A job's delivery (queue.ts): why the queue delivered it; `instance` is then the worker's. */
  readonly delivery?: DeliveryReason
}

/**
 * Why the queue delivered a job: its first delivery; again once its visibility timeout ended
 * without an answer (its worker died, or the job still ran); again after an answer that was not
 * definite (retry); to two workers at the same moment (duplicate, both deliveries); once more after
 * its acknowledgement (late).
 */
export type DeliveryReason = 'first' | 'visibility' | 'retry' | 'duplicate' | 'late'

/** An executed effect, as found after the run in the ledger table or the provider's log. */
export interface Effect {
  readonly mode: Mode
  readonly scope: string
  readonly key: string
  readonly amount: number
  /** The ledger row's id, or the provider's charge id: what the response body must name. */
  readonly ref: string
}

/** An idempotency record as left in the store's table after the drain. */
export interface StoredRecordRow {
  readonly scope: string
  readonly key: string
  readonly state: string
  readonly responseStatus: number | null
}

export interface FaultEvent {
  readonly kind: string
  readonly at: number
  readonly detail: string
  /** Evidence that the fault bit (backends terminated, replies dropped, requests in flight...). */
  readonly effective: boolean
  /**
   * When it acted on the system, from the first change to what it disturbs settling again (a
   * database fault: until the apps' connections can work again); missing for a fault that failed.
   */
  readonly from?: number
  readonly to?: number
}

/** One process of an app instance: the checker's proof that an owner was dead. */
export interface Incarnation {
  readonly instance: number
  readonly pid: number
  readonly startedAt: number
  endedAt: number | null
  /** killed: SIGKILL by the harness; shutdown: a rolling restart; crashed: died on its own. */
  end: 'killed' | 'shutdown' | 'crashed' | null
}

/**
 * What a scenario did to the system besides sending requests: an operator's force release of a
 * key (the same statement as `store.forceRelease`), or one instance cut from the database.
 */
export interface Intervention {
  /**
   * table-lock: the records table locked for a moment, by something that is not a duplicate
   * (atomic-duplicate); listener-kill: the settlement listener of `instance` terminated (wait-lease, wait-atomic).
   */
  readonly kind: 'force-release' | 'partition' | 'table-lock' | 'listener-kill'
  readonly scope: string
  readonly key: string
  readonly from: number
  readonly to: number
  /** The instance cut off (partition), or whose listener was killed. */
  readonly instance: number | null
  /** Force release: the store deleted an in-progress record; table lock: the lock was taken; listener kill: a listener was terminated. */
  readonly effective: boolean
}

/** A process of the harness (an app instance, the reconciler) that died without being killed. */
export interface Crash {
  readonly process: string
  readonly at: number
  /** The exit code or signal. */
  readonly exit: string
  /** A known defect outside the plugin that explains it, or null (then it is a violation). */
  readonly knownCause: string | null
  /** The end of its stderr. */
  readonly stderr: string
  /** The error its stderr ended with (crashes.ts, fatalError), when it printed one. */
  readonly error?: string | null
}

export interface History {
  readonly operations: readonly Operation[]
  readonly attempts: readonly Attempt[]
  readonly effects: readonly Effect[]
  readonly records: readonly StoredRecordRow[]
  readonly faults: readonly FaultEvent[]
  readonly crashes: readonly Crash[]
  /** The instances' and the reconciler's evidence logs, merged in time order (evidence.ts). */
  readonly evidence: readonly EvidenceLine[]
  readonly incarnations: readonly Incarnation[]
  readonly interventions: readonly Intervention[]
}

/** What every 2xx body of the payments API carries, so the checker can tie an answer to an effect. */
export interface PaymentBody {
  readonly mode: Mode
  readonly scope: string
  readonly key: string
  readonly amount: number
  readonly ref: string
}

export function recordId (scope: string, key: string): string {
  return JSON.stringify([scope, key])
}
