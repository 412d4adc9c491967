import type { RequestState } from './context.js'
import type { Engine } from './engine.js'
import { TransactionEndedError } from './errors.js'
import { observe } from './observe.js'
import { clearInFlight, rememberCompleted } from './prefiltering.js'
import type { Answer, ClaimAcquired, Lease, StoredResponse } from './store.js'
import { isThenable } from './thenable.js'
import { bounded, boundedPromise } from './timeout.js'

/*
 * Writes a key's outcome to the store once the lifecycle (lib/core/lifecycle.ts) has decided it: record
 * the response, hold the key for the reconciler, release it, or give back a claim that landed too
 * late. What is decided is never undone by a store that fails: a record or a hold is tried again,
 * briefly while the client waits, then in the background while the lease keeps being renewed,
 * until the store answers. Losing it would let a retry run the operation a second time (the store
 * contract: a key is lost only when its owner cannot reach the store for longer than its lease).
 */

/** Delays between the tries the client waits for (complete, hold, release): about 300 ms in all. */
const WAITED_RETRY_DELAYS_MS = [50, 250]
/** Then, for complete and hold, in the background: from 1 s, doubling, at most 10 s apart. */
const BACKGROUND_FIRST_DELAY_MS = 1_000
const BACKGROUND_MAX_DELAY_MS = 10_000

/** One settling store call, and what to say of its answer. */
interface Settlement {
  readonly operation: 'complete' | 'hold' | 'release'
  /** complete: the response; hold and release: null. */
  readonly response: StoredResponse | null
  /** Why the key is released or held (for the log), or when a record was asked (for the pre-filter copy's retention). */
  readonly reason: string
  readonly since: number
}

/**
 * Records the owner's response. Done at once when the store answers directly (the memory store),
 * otherwise a promise that resolves once the record is written or the tries the client waits for
 * are spent (the tries then go on in the background).
 */
export function record (engine: Engine, state: RequestState, response: StoredResponse): void | Promise<void> {
  return settleWith(engine, state, { operation: 'complete', response, reason: '', since: Date.now() })
}

/**
 * Releases the key (a definite failure: a retry runs the operation again) or holds it for the
 * reconciler (an indeterminate one: an effect may have happened, and its recorded steps must stay).
 */
export function conclude (engine: Engine, state: RequestState, fate: 'release' | 'hold', reason: string): Promise<void> {
  clearInFlight(engine, state)
  if (fate === 'hold' && engine.store.hold === undefined) {
    observe(engine.metrics, state, 'store_error', 'error', `idempotency: ${reason}, and an effect may have happened, but the store cannot hold a key for the reconciler (it has no hold()); the key is taken over by a retry once its lease lapses`)
    state.lifecycle.settled()
    return Promise.resolve()
  }
  return Promise.resolve(settleWith(engine, state, { operation: fate, response: null, reason, since: 0 }))
}

/**
 * Gives back a claim that acquired the key but cannot be used: it landed after its storeTimeout or
 * after its lease (the request was answered 503), or after another answer went out (a
 * handlerTimeout). Nothing ran under it. A takeover (lease mode) holds the record of an operation
 * that may have run partly, with its recorded steps: its lease is given up instead (renew to 0), so
 * the next attempt takes it over with its steps at once. Atomic mode's release rolls back, which also
 * frees the transaction's connection and the row's lock.
 */
export function giveBack (engine: Engine, state: RequestState, result: ClaimAcquired, why: string): void {
  if (state.markedInFlight) clearInFlight(engine, state)
  const store = engine.store
  const lease = result.lease
  const keepSteps = result.transaction === undefined && result.takeover
  const reported = (given: boolean): void => {
    if (given) observe(engine.metrics, state, 'released', 'warn', `idempotency: gave back a claim that ${why}`)
    else observe(engine.metrics, state, 'lease_lost', 'warn', `idempotency: a claim ${why}, and was taken over before it could be given back`)
  }
  const failed = (err: unknown): void => {
    observe(engine.metrics, state, 'store_error', 'error', `idempotency: could not give back a claim that ${why}; it frees itself when its lease expires`, err)
  }
  const given = bounded(keepSteps ? 'renew' : 'release', state.settings.storeTimeout, () => keepSteps ? store.renew(lease, 0) : store.release(lease))
  if (isThenable(given)) given.then(reported, failed)
  else reported(given)
}

/** The store call a settlement makes (`hold` exists: conclude checked). */
function call (engine: Engine, state: RequestState, settlement: Settlement): Answer<boolean> {
  const store = engine.store
  const lease = state.lifecycle.lease as Lease
  switch (settlement.operation) {
    case 'complete': return store.complete(lease, settlement.response as StoredResponse, state.settings.ttl)
    case 'release': return store.release(lease)
    case 'hold': return (store.hold as NonNullable<typeof store.hold>)(lease)
  }
}

/** The store's answer to a settlement: false means the key is no longer this request's. Settles the lifecycle. */
function answered (engine: Engine, state: RequestState, settlement: Settlement, owned: boolean): void {
  if (!owned) state.lifecycle.lose()
  const { operation, reason } = settlement
  if (operation === 'complete') {
    if (owned) {
      observe(engine.metrics, state, 'recorded', 'debug', 'idempotency: response recorded')
      if (state.context !== null) rememberCompleted(engine, state, state.context.fingerprint, settlement.response as StoredResponse, state.settings.ttl, settlement.since)
    } else {
      observe(engine.metrics, state, 'lease_lost', 'warn', 'idempotency: the key was taken over while this request ran; its response was not recorded')
    }
  } else if (operation === 'release') {
    if (owned) observe(engine.metrics, state, 'released', 'debug', `idempotency: key released (${reason})`)
    else observe(engine.metrics, state, 'lease_lost', 'warn', `idempotency: nothing to release (${reason}): the key was taken over or force-released meanwhile`)
  } else if (owned) {
    observe(engine.metrics, state, 'held', 'warn', `idempotency: ${reason}, and an effect may have happened; key held in progress for reconciliation`)
  } else {
    observe(engine.metrics, state, 'lease_lost', 'warn', `idempotency: ${reason}, but the key was taken over meanwhile`)
  }
  state.lifecycle.settled()
}

/**
 * One settling store call, tried again on failure. A value when the store answered at once (the
 * memory store: nothing is allocated for the tries that did not happen).
 */
function settleWith (engine: Engine, state: RequestState, settlement: Settlement): void | Promise<void> {
  let first: Answer<boolean>
  try {
    first = call(engine, state, settlement)
  } catch (err) {
    return failed(engine, state, settlement, err)
  }
  if (!isThenable(first)) return answered(engine, state, settlement, first)
  return boundedPromise(settlement.operation, state.settings.storeTimeout, first).then(
    (owned) => { answered(engine, state, settlement, owned) },
    (err: unknown) => failed(engine, state, settlement, err)
  )
}

function failed (engine: Engine, state: RequestState, settlement: Settlement, err: unknown): void | Promise<void> {
  return endedByHandler(engine, state, err) ? undefined : retryWaited(engine, state, settlement, err)
}

async function retryWaited (engine: Engine, state: RequestState, settlement: Settlement, firstError: unknown): Promise<void> {
  let failure = firstError
  for (const delay of WAITED_RETRY_DELAYS_MS) {
    await sleep(delay)
    if (!state.lifecycle.holding) return answered(engine, state, settlement, false)
    try {
      return answered(engine, state, settlement, await bounded(settlement.operation, state.settings.storeTimeout, () => call(engine, state, settlement)))
    } catch (err) {
      if (endedByHandler(engine, state, err)) return
      failure = err
    }
  }
  if (settlement.operation === 'release') {
    // Nothing ran that a retry could repeat: the lease lapses on its own once renewal stops.
    observe(engine.metrics, state, 'store_error', 'error', 'idempotency: could not release the key; it frees itself when its lease expires', failure)
    state.lifecycle.settled()
    return
  }
  observe(engine.metrics, state, 'store_error', 'error', `idempotency: could not ${settlement.operation === 'complete' ? 'record the response' : 'hold the key'} yet; trying again in the background while its lease is kept`, failure)
  retryInBackground(engine, state, settlement, BACKGROUND_FIRST_DELAY_MS)
}

function retryInBackground (engine: Engine, state: RequestState, settlement: Settlement, delay: number): void {
  setTimeout(() => {
    if (engine.closed || !state.lifecycle.holding) {
      // Closed: the process is going; lost: another attempt owns the key. Either way renewal stops.
      if (state.lifecycle.phase === 'settling') state.lifecycle.settled()
      return
    }
    Promise.resolve(bounded(settlement.operation, state.settings.storeTimeout, () => call(engine, state, settlement))).then(
      (owned) => { answered(engine, state, settlement, owned) },
      () => { retryInBackground(engine, state, settlement, Math.min(delay * 2, BACKGROUND_MAX_DELAY_MS)) }
    )
  }, delay).unref()
}

/**
 * Atomic mode: the handler ended the request's transaction, and the store held the key in its
 * place (TransactionEndedError). Never tried again: there is no transaction left to settle, and the
 * hold is the outcome (a release tried again would remove the held record).
 */
function endedByHandler (engine: Engine, state: RequestState, err: unknown): boolean {
  if (!(err instanceof TransactionEndedError)) return false
  observe(engine.metrics, state, 'held', 'error', 'idempotency: the handler ended the request\'s transaction itself; the key is held for the reconciler', err)
  state.lifecycle.settled()
  return true
}

const sleep = (ms: number): Promise<void> => new Promise((resolve) => { setTimeout(resolve, ms) })
