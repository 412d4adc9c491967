import type { Fingerprint, RecordId, SettlementHandlers, StoredResponse } from './store.js'

/**
 * The optional pre-filter in front of the store. It answers retry storms of completed keys from
 * memory, and never decides who executes nor gives an answer the store would not give: the store
 * alone does. A cache can lose a record, and a marker can be older than the store's state, so:
 * - a hit may only replay a record the store already committed (a completed copy, which never
 *   outlives the store's record);
 * - an in-flight marker never answers: it only lets a duplicate on a route with `wait` wait without
 *   asking the store, which is asked before any answer (409, 422 or the replay) is given;
 * - a miss, an error or a slow answer falls through to the store as if there were no pre-filter.
 *
 * Every method is one atomic operation on one (scope, key); implementations must keep keys of
 * different (scope, key) pairs from colliding and bound their own latency (throw on timeout).
 *
 * The `RecordId` object passed in stands for the request: the core passes the same object to all of
 * one request's calls, and a new object per request. A pre-filter may use it to recognise the
 * request's own in-flight marker.
 */
export interface IdempotencyPrefilter {
  /**
   * What the pre-filter holds for (scope, key), or null. The caller's own in-flight marker is not
   * reported: it says nothing about another request, and a request must never wait on itself.
   */
  lookup (id: RecordId): Promise<PrefilterHit | null>

  /**
   * Optional: `lookup`, and when nothing is there, an in-flight marker for `fingerprint` (for at most
   * `ttlMs`) set in the same atomic step, so a fresh key costs one round trip before the store is
   * asked. `marked` says whether the caller holds the marker, set now or already there as its own
   * (a command a client re-sent after its answer was lost finds the marker its first delivery wrote,
   * and reports it as marked, not as a hit): the core then owns it (it is replaced by `remember`, or
   * cleared when the store does not hand the key to this request).
   */
  lookupOrMark? (id: RecordId, fingerprint: Fingerprint, ttlMs: number): Promise<{ readonly hit: PrefilterHit | null, readonly marked: boolean }>

  /**
   * Marks (scope, key) in flight while its owner runs. `ttlMs` never exceeds the owner's lease, so a
   * stale marker (its owner crashed) delays a waiting retry by at most that long. The marker is the
   * caller's: it replaces another request's marker, never a completed record.
   */
  markInFlight (id: RecordId, fingerprint: Fingerprint, ttlMs: number): Promise<void>

  /**
   * Removes the caller's own in-flight marker (the owner released the key); leaves another request's
   * marker and any completed record alone. Safe to call when the caller does not know whether its
   * marker was written.
   */
  clearInFlight (id: RecordId): Promise<void>

  /**
   * Copies in a record the store has committed as completed, replacing the marker. `ttlMs` never
   * exceeds the record's remaining retention in the store, so the copy never outlives the original.
   */
  remember (id: RecordId, fingerprint: Fingerprint, response: StoredResponse, ttlMs: number): Promise<void>

  /** Stops what the pre-filter started (never a client the user passed in). */
  close (): Promise<void>

  /**
   * Optional: as {@link IdempotencyStore.watchSettlements}, for the settlements the pre-filter
   * sees: an owner's in-flight marker replaced by its completed copy (`remember`) or cleared
   * (`clearInFlight`). Markers are written on routes with `wait` only, which are the settlements a
   * duplicate may wait for. Waiters listen to the store's notices and to these alike: either wakes
   * them, and they read the record in the store.
   */
  watchSettlements? (handlers: SettlementHandlers): () => void
}

export type PrefilterHit =
  | { readonly state: 'in_progress', readonly fingerprint: Fingerprint }
  | { readonly state: 'completed', readonly fingerprint: Fingerprint, readonly response: StoredResponse }
