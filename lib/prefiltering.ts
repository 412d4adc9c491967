import type { RequestState } from './context.js'
import type { Engine } from './engine.js'
import { observe } from './observe.js'
import type { PrefilterHit } from './prefilter.js'
import type { Fingerprint, StoredResponse } from './store.js'

/*
 * How the lifecycle uses the optional pre-filter. It is advisory only: a hit can replay a record the
 * store already committed or refuse a duplicate while its owner runs; a miss, an error or a timeout
 * is a fall-through to the store, which alone decides who executes. Writes to it are fire-and-forget
 * (logged on failure): a lost write only means the next duplicate asks the store.
 */

/** A copy must never outlive the store's record: the store's ttl started before we measured. */
const RETENTION_MARGIN_MS = 1000

export async function consultPrefilter (engine: Engine, state: RequestState): Promise<PrefilterHit | null> {
  const prefilter = engine.prefilter
  if (prefilter === null) return null
  try {
    return await prefilter.lookup({ scope: state.scope, key: state.key })
  } catch (err) {
    observe(engine.metrics, state, 'prefilter_error', 'warn', 'idempotency: pre-filter lookup failed; asking the store', err)
    return null
  }
}

export function markInFlight (engine: Engine, state: RequestState, fingerprint: Fingerprint): void {
  const prefilter = engine.prefilter
  if (prefilter === null) return
  prefilter.markInFlight({ scope: state.scope, key: state.key }, fingerprint, state.settings.lease)
    .catch((err: unknown) => { observe(engine.metrics, state, 'prefilter_error', 'warn', 'idempotency: pre-filter in-flight marker not set', err) })
}

/**
 * Copies a record the store committed into the pre-filter, for at most `retentionMs` (the store's
 * remaining retention, measured from `since`) minus a margin.
 */
export function rememberCompleted (engine: Engine, state: RequestState, fingerprint: Fingerprint, response: StoredResponse, retentionMs: number, since: number): void {
  const prefilter = engine.prefilter
  if (prefilter === null) return
  const ttl = retentionMs - (Date.now() - since) - RETENTION_MARGIN_MS
  if (ttl <= 0) return
  prefilter.remember({ scope: state.scope, key: state.key }, fingerprint, response, ttl)
    .catch((err: unknown) => { observe(engine.metrics, state, 'prefilter_error', 'warn', 'idempotency: pre-filter copy of the record not written', err) })
}

export function clearInFlight (engine: Engine, state: RequestState): void {
  const prefilter = engine.prefilter
  if (prefilter === null) return
  prefilter.clearInFlight({ scope: state.scope, key: state.key })
    .catch((err: unknown) => { observe(engine.metrics, state, 'prefilter_error', 'warn', 'idempotency: pre-filter in-flight marker not cleared', err) })
}
