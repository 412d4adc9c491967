import type { Fingerprint, RecordId, StoredResponse } from './store.js'

/**
 * The optional pre-filter in front of the store (issue: Redis pre-filter). It answers duplicates
 * from memory during retry storms, and never decides who executes: the store alone does. A cache can
 * lose a record and a lock can expire while work still runs (seeds), so everything here is advisory:
 * - a hit may only replay a record the store already committed, or refuse a duplicate of the same
 *   request while an owner runs (409, or wait): an in-flight marker for ANOTHER fingerprint is not
 *   trusted for a 422 (a marker can be set just before the store says who owns the key), the store
 *   answers that;
 * - a miss, an error or a slow answer falls through to the store as if there were no pre-filter.
 *
 * Every method is one atomic operation on one (scope, key); implementations must keep keys of
 * different (scope, key) pairs from colliding and bound their own latency (throw on timeout).
 */
export interface IdempotencyPrefilter {
  /** What the pre-filter holds for (scope, key), or null. */
  lookup (id: RecordId): Promise<PrefilterHit | null>

  /**
   * Optional: `lookup`, and when nothing is there, an in-flight marker for `fingerprint` (for at most
   * `ttlMs`) set in the same atomic step, so a fresh key costs one round trip before the store is
   * asked. `marked` says whether the marker was set: the core then owns it (it is replaced by
   * `remember`, or cleared when the store does not hand the key to this request).
   */
  lookupOrMark? (id: RecordId, fingerprint: Fingerprint, ttlMs: number): Promise<{ readonly hit: PrefilterHit | null, readonly marked: boolean }>

  /**
   * Marks (scope, key) in flight while its owner runs. `ttlMs` never exceeds the owner's lease, so a
   * stale marker (its owner crashed) delays a retry by at most that long. Never replaces a completed
   * record.
   */
  markInFlight (id: RecordId, fingerprint: Fingerprint, ttlMs: number): Promise<void>

  /** Removes an in-flight marker (the owner released the key); leaves a completed record alone. */
  clearInFlight (id: RecordId): Promise<void>

  /**
   * Copies in a record the store has committed as completed, replacing the marker. `ttlMs` never
   * exceeds the record's remaining retention in the store, so the copy never outlives the original.
   */
  remember (id: RecordId, fingerprint: Fingerprint, response: StoredResponse, ttlMs: number): Promise<void>

  /** Stops what the pre-filter started (never a client the user passed in). */
  close (): Promise<void>
}

export type PrefilterHit =
  | { readonly state: 'in_progress', readonly fingerprint: Fingerprint }
  | { readonly state: 'completed', readonly fingerprint: Fingerprint, readonly response: StoredResponse }
