import { InvalidOptionError } from './errors.js'
import type { IdempotencyPrefilter } from './prefilter.js'
import type { IdempotencyStore } from './store.js'

/* The store and pre-filter given to the plugin or to a job runner, checked once when it is built. */

const STORE_METHODS = ['claim', 'complete', 'release', 'renew', 'get', 'purgeExpired', 'close'] as const
const PREFILTER_METHODS = ['lookup', 'markInFlight', 'clearInFlight', 'remember', 'close'] as const

export function checkStore (store: IdempotencyStore): void {
  const missing = typeof store === 'object' && store !== null
    ? STORE_METHODS.filter((method) => typeof (store as unknown as Record<string, unknown>)[method] !== 'function')
    : [...STORE_METHODS]
  if (missing.length > 0) {
    throw new InvalidOptionError('option "store"', `an IdempotencyStore (missing ${missing.join(', ')})`, store)
  }
  const check: unknown = store.check
  if (check !== undefined && typeof check !== 'function') {
    throw new InvalidOptionError('option "store".check', 'a function when present (IdempotencyStore.check, called at boot)', check)
  }
}

export function checkTransactions (store: IdempotencyStore | undefined, option: string): void {
  if (typeof store?.claimInTransaction !== 'function') {
    throw new InvalidOptionError(option, 'false unless the store supports transactions (claimInTransaction), as the Postgres driver does', true)
  }
}

export function checkPrefilter (prefilter: IdempotencyPrefilter): void {
  const missing = typeof prefilter === 'object' && prefilter !== null
    ? PREFILTER_METHODS.filter((method) => typeof (prefilter as unknown as Record<string, unknown>)[method] !== 'function')
    : [...PREFILTER_METHODS]
  if (missing.length > 0) {
    throw new InvalidOptionError('option "prefilter"', `an IdempotencyPrefilter (missing ${missing.join(', ')})`, prefilter)
  }
}
