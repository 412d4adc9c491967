import { InvalidOptionError } from './errors.js'
import { missingMethods } from './validate.js'
import type { IdempotencyPrefilter } from './prefilter.js'
import type { IdempotencyStore } from './store.js'

/* The store and pre-filter given to the plugin or to a job runner, checked once when it is built. */

const STORE_METHODS = ['claim', 'complete', 'release', 'renew', 'get', 'purgeExpired', 'close'] as const
const PREFILTER_METHODS = ['lookup', 'markInFlight', 'clearInFlight', 'remember', 'close'] as const

/** `option` names it in the error: the plugin's `option "store"`, a runner's own. */
export function checkStore (store: IdempotencyStore, option = 'option "store"'): void {
  const missing = missingMethods(store, STORE_METHODS)
  if (missing.length > 0) {
    throw new InvalidOptionError(option, `an IdempotencyStore (missing ${missing.join(', ')})`, store)
  }
  const check: unknown = store.check
  if (check !== undefined && typeof check !== 'function') {
    throw new InvalidOptionError(`${option}.check`, 'a function when present (IdempotencyStore.check, called at boot)', check)
  }
}

export function checkTransactions (store: IdempotencyStore | undefined, option: string): void {
  if (typeof store?.claimInTransaction !== 'function') {
    throw new InvalidOptionError(option, 'false unless the store supports transactions (claimInTransaction), as the Postgres driver does', true)
  }
}

export function checkPrefilter (prefilter: IdempotencyPrefilter, option = 'option "prefilter"'): void {
  const missing = missingMethods(prefilter, PREFILTER_METHODS)
  if (missing.length > 0) {
    throw new InvalidOptionError(option, `an IdempotencyPrefilter (missing ${missing.join(', ')})`, prefilter)
  }
}
