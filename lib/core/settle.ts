import type { RequestState } from './context.js'
import type { Engine } from './engine.js'
import { RolledBackError, TransactionEndedError } from './errors.js'
import type { Ending } from './lifecycle.js'
import { observe } from './observe.js'
import { conclude } from './outcome.js'
import { clearInFlight, rememberCompleted } from './prefiltering.js'
import { deliverEnqueued } from './recovery.js'
import type { Lease, StoredResponse } from './store.js'
import { isThenable } from './thenable.js'
import { bounded } from './timeout.js'

/*
 * The owner's outcome, for every door: a failure's fate (release or hold) carried out, and atomic
 * mode's commit of the record with the operation's writes. What an adapter sends (a reply, a value,
 * an error) is its own; what happens to the key is decided here and in lib/core/lifecycle.ts.
 */

/**
 * A failure's fate (release or hold), carried out. When the answer interrupted a handler that
 * still runs, the key stays held and renewed until the handler returns, and the failure answer
 * goes out without waiting.
 */
export function decide (engine: Engine, state: RequestState, ending: Exclude<Ending, 'answered'>, reason: string): Promise<void> {
  const fate = state.lifecycle.fate(ending)
  if (!isThenable(fate)) return conclude(engine, state, fate === 'hold' ? 'hold' : 'release', reason)
  observe(engine.metrics, state, 'not_recorded', 'warn', `idempotency: the answer (${reason}) interrupted a handler that still runs; the key stays held until it returns`)
  fate.then((decided) => conclude(engine, state, decided === 'hold' ? 'hold' : 'release',
    decided === 'hold' ? `${reason}, and the handler completed after it` : reason))
    .catch(/* c8 ignore next: conclude reports the store's failures itself */ () => {})
  return Promise.resolve()
}

/** Why atomic mode's commit did not commit: nothing happened, the operation ended the transaction, or no one can tell. */
export type CommitFailure = 'not-committed' | 'transaction-ended' | 'outcome-unknown'

/**
 * Atomic mode: records `response` and commits the transaction, the operation's writes with it. Null
 * once committed; otherwise what went wrong. If the commit failed, nothing of the operation
 * happened. If the store cannot tell (the connection dropped or timed out after COMMIT was sent),
 * the retry replays the committed outcome or runs the operation afresh, whichever is true. If the
 * operation ended the transaction itself, the store held the key for the reconciler.
 */
export async function commitRecord (engine: Engine, state: RequestState, response: StoredResponse): Promise<{ readonly failure: CommitFailure, readonly error: unknown } | null> {
  const lease = state.lifecycle.lease as Lease
  try {
    const since = Date.now()
    const committed = await bounded('complete', state.settings.storeTimeout, () => engine.store.complete(lease, response, state.settings.ttl))
    if (!committed) throw new RolledBackError('the transaction had already ended (rolled back) before the commit')
    observe(engine.metrics, state, 'recorded', 'debug', 'idempotency: response recorded and transaction committed')
    deliverEnqueued(engine, state)
    if (state.context !== null) rememberCompleted(engine, state, state.context.fingerprint, response, state.settings.ttl, since)
    return null
  } catch (err) {
    clearInFlight(engine, state)
    if (err instanceof RolledBackError) {
      observe(engine.metrics, state, 'store_error', 'error', 'idempotency: the transaction was rolled back instead of committed (500)', err)
      return { failure: 'not-committed', error: err }
    }
    if (err instanceof TransactionEndedError) {
      observe(engine.metrics, state, 'held', 'error', 'idempotency: the operation ended its transaction itself; the key is held for the reconciler (500)', err)
      return { failure: 'transaction-ended', error: err }
    }
    observe(engine.metrics, state, 'store_error', 'error', 'idempotency: the commit was sent but its outcome is unknown (503)', err)
    return { failure: 'outcome-unknown', error: err }
  } finally {
    state.lifecycle.settled()
  }
}
