import type { RequestState } from './context.js'
import type { Engine } from './engine.js'
import { observe } from './observe.js'
import type { PrefilterHit } from './prefilter.js'
import type { Fingerprint, RecordId, StoredResponse } from './store.js'
import { bounded } from './timeout.js'

/*
 * How the lifecycle uses the optional pre-filter. It is advisory only: a hit can replay a record the
 * store already committed or refuse a duplicate while its owner runs; a miss, an error or a timeout
 * is a fall-through to the store, which alone decides who executes. Writes to it are fire-and-forget
 * (logged on failure): a lost write only means the next duplicate asks the store.
 */

/** A copy must never outlive the store's record: the store's ttl started before we measured. */
const RETENTION_MARGIN_MS = 1000

/**
 * What the pre-filter holds for the key. On the first look (`mark`), a pre-filter that can do it
 * also sets this request's in-flight marker when nothing is there, in the same round trip.
 */
export async function consultPrefilter (engine: Engine, state: RequestState, fingerprint: Fingerprint, mark: boolean): Promise<PrefilterHit | null> {
  const prefilter = engine.prefilter
  if (prefilter === null) return null
  // Bounded here as well as by the pre-filter itself: a pre-filter that never answers must not
  // hold a request (the store is there to answer).
  const timeout = state.settings.storeTimeout
  try {
    const lookupOrMark = prefilter.lookupOrMark
    if (mark && lookupOrMark !== undefined) {
      const looked = await bounded('prefilter lookup', timeout, () => lookupOrMark.call(prefilter, recordIdOf(state), fingerprint, state.settings.lease))
      state.markedInFlight = looked.marked
      return looked.hit
    }
    return await bounded('prefilter lookup', timeout, () => prefilter.lookup(recordIdOf(state)))
  } catch (err) {
    observe(engine.metrics, state, 'prefilter_error', 'warn', 'idempotency: pre-filter lookup failed; asking the store', err)
    return null
  }
}

/** The (scope, key) of the request, one object for all its pre-filter calls (a driver may cache by it). */
function recordIdOf (state: RequestState): RecordId {
  return (state.recordId ??= { scope: state.scope, key: state.key })
}

export function markInFlight (engine: Engine, state: RequestState, fingerprint: Fingerprint): void {
  const prefilter = engine.prefilter
  if (prefilter === null || state.markedInFlight) return
  prefilter.markInFlight(recordIdOf(state), fingerprint, state.settings.lease)
    .catch((err: unknown) => { observe(engine.metrics, state, 'prefilter_error', 'warn', 'idempotency: pre-filter in-flight marker not set', err) })
}

/**
 * Copies a record the store committed into the pre-filter, for at most `retentionMs` (the store's
 * remaining retention, measured from `since`) minus a margin. False when nothing was written (no
 * pre-filter, or too little retention left for a copy).
 */
export function rememberCompleted (engine: Engine, state: RequestState, fingerprint: Fingerprint, response: StoredResponse, retentionMs: number, since: number): boolean {
  const prefilter = engine.prefilter
  if (prefilter === null) return false
  const ttl = retentionMs - (Date.now() - since) - RETENTION_MARGIN_MS
  if (ttl <= 0) return false
  state.markedInFlight = false // the copy replaces the marker
  prefilter.remember(recordIdOf(state), fingerprint, response, ttl)
    .catch((err: unknown) => { observe(engine.metrics, state, 'prefilter_error', 'warn', 'idempotency: pre-filter copy of the record not written', err) })
  return true
}

export function clearInFlight (engine: Engine, state: RequestState): void {
  const prefilter = engine.prefilter
  if (prefilter === null) return
  state.markedInFlight = false
  prefilter.clearInFlight(recordIdOf(state))
    .catch((err: unknown) => { observe(engine.metrics, state, 'prefilter_error', 'warn', 'idempotency: pre-filter in-flight marker not cleared', err) })
}
