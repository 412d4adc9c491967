import type { RequestState } from './context.js'
import type { Engine } from './engine.js'
import { observe } from './observe.js'
import { withTimeout } from './timeout.js'

/**
 * The owner renews its lease at a third of its length while the handler runs, so a slow handler
 * is never taken over; only an owner that stopped (crash, abandoned request) lets its lease lapse.
 */
export function renewWhileRunning (engine: Engine, state: RequestState): void {
  const interval = Math.max(1, Math.floor(state.settings.lease / 3))
  const timer = setTimeout(() => {
    state.renewTimer = null
    renew(engine, state).then((owned) => {
      if (owned && state.phase === 'owner' && !state.abandoned) renewWhileRunning(engine, state)
    }, /* c8 ignore next */ () => {})
  }, interval)
  timer.unref()
  state.renewTimer = timer
}

async function renew (engine: Engine, state: RequestState): Promise<boolean> {
  const lease = state.lease
  if (lease === null || state.phase !== 'owner') return false
  try {
    const owned = await withTimeout('renew', state.settings.storeTimeout, () => engine.store.renew(lease, state.settings.lease))
    if (!owned) observe(engine.metrics, state, 'lease_lost', 'warn', 'idempotency: lease lost to another attempt; this response will not be recorded')
    return owned
  } catch (err) {
    // Keep trying: a store blip must not hand a running handler's key to a retry.
    observe(engine.metrics, state, 'store_error', 'warn', 'idempotency: lease renewal failed', err)
    return true
  }
}

export function stopRenewal (state: RequestState): void {
  if (state.renewTimer !== null) {
    clearTimeout(state.renewTimer)
    state.renewTimer = null
  }
}
