import { sealAtRest } from './encryption.js'
import { deriveFingerprintKeys, type FingerprintKeys } from './fingerprint-keys.js'
import type { Keyring } from './keyring.js'
import type { Metrics } from './observe.js'
import type { IdempotencyPrefilter } from './prefilter.js'
import { SharedCalls } from './shared-calls.js'
import type { IdempotencyStore } from './store.js'
import { Waiters } from './waiters.js'

/** What every attempt of one registration (or one job runner) shares. */
export interface Engine {
  /** The store given (sealed when `encryption` is set): its methods are the only way to it (lib/core/store.ts). */
  readonly store: IdempotencyStore
  readonly prefilter: IdempotencyPrefilter | null
  readonly waiters: Waiters
  /** The store calls of waiting duplicates, shared by those of the same key (lib/core/shared-calls.ts). */
  readonly sharedCalls: SharedCalls
  /** The `metrics` option's instruments, or null (lib/core/observe.ts). */
  readonly metrics: Metrics | null
  /** MAC keys of keyed fingerprints, derived from the `encryption` option (lib/core/fingerprint-keys.ts), or null. */
  readonly fingerprintKeys: FingerprintKeys | null
  /** Set when the Fastify instance (or the runner) closes: settlements still retrying in the background stop. */
  closed: boolean
}

/** The engine of a store (and pre-filter): with a keyring, every record is sealed and every fingerprint keyed. */
export function createEngine (store: IdempotencyStore, prefilter: IdempotencyPrefilter | null, keyring: Keyring | null, metrics: Metrics | null): Engine {
  // With `encryption`, every driver and the pre-filter hold sealed responses (lib/core/encryption.ts).
  const atRest = sealAtRest(keyring, store, prefilter)
  return {
    store: atRest.store,
    prefilter: atRest.prefilter,
    waiters: new Waiters(atRest.store, atRest.prefilter),
    sharedCalls: new SharedCalls(),
    metrics,
    fingerprintKeys: keyring === null ? null : deriveFingerprintKeys(keyring),
    closed: false
  }
}

/** The registration (or runner) closed: background settlements stop retrying, and the settlement watch ends. */
export function closeEngine (engine: Engine): void {
  engine.closed = true
  engine.waiters.stop()
}
