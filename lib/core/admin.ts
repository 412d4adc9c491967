import type { Fingerprint, StepResults, StoredResponse } from './store.js'
import type { Reconciler, ReconcileOptions, ReconcileReport, ReconcilerOptions } from './reconcile.js'
import type { RecordId } from './store.js'

/**
 * A record as an operator sees it (`store.inspect`): for support and incident work, never for the
 * request path. Scoped like everything else: (scope, key) names one record.
 */
export interface InspectedRecord extends RecordId {
  readonly state: 'in_progress' | 'completed'
  readonly fingerprint: Fingerprint
  /** Held for the reconciler after an indeterminate failure (retries get 409; it never expires while held). */
  readonly indeterminate: boolean
  readonly steps: StepResults
  readonly createdAt: Date
  /** In progress: ms until the owner's lease ends (0 once it lapsed). */
  readonly leaseRemainingMs: number
  /** Ms until the record expires; Infinity while it is held for the reconciler. */
  readonly expiresInMs: number
  /** Completed: the recorded response (body null when it was not retained). */
  readonly response: StoredResponse | null
}

/** Operator tools and the reconciler, on the drivers that shipped with the plugin (memory, Postgres). */
export interface RecoveryTools {
  /** One record, in progress or completed, or null. */
  inspect (id: RecordId): Promise<InspectedRecord | null>
  /**
   * Records held for the reconciler (indeterminate failures), oldest first, at most `limit`
   * (default 100). They never expire on their own: they stay until the reconciler resolves them or
   * `forceRelease` removes them, so this is the list to watch (and alert on when it grows).
   */
  listHeld (limit?: number): Promise<InspectedRecord[]>
  /**
   * Deletes an in-progress record whoever owns it, so the next retry runs the operation afresh: for
   * a key an operator knows to be safe to re-run. A live owner loses its lease (its outcome is not
   * recorded). False when there was no in-progress record.
   */
  forceRelease (id: RecordId): Promise<boolean>
  /** One reconciliation pass over records left in progress; see ReconcileOptions. */
  reconcile (options: ReconcileOptions): Promise<ReconcileReport>
  /** Runs `reconcile` on an interval (Postgres: in one instance at a time) until `stop()`. */
  startReconciler (options: ReconcilerOptions): Reconciler
}
