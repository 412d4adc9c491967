import type { IdempotencyStore } from '../../lib/index.js'

/** A store wrapped so that every method call is counted, by name. */
export interface CountingStore<S extends IdempotencyStore> {
  readonly store: S
  /** Calls per method since the last reset(). */
  readonly calls: () => Record<string, number>
  /** Every call since the last reset(), whatever the method. */
  readonly total: () => number
  /** Forgets the calls so far: the boot check (`check`, at ready()) is not a request's. */
  readonly reset: () => void
}

/**
 * Wraps `base` in a Proxy that counts each method call (claim, get, complete, release, renew, and
 * whatever else the plugin calls), then calls the store's own method on the store itself, so the
 * store behaves exactly as unwrapped. The plugin calls the methods of the object it was given
 * (test/plugin/wrapped-store.test.ts), so the counts are every call the plugin made.
 */
export function countingStore<S extends IdempotencyStore> (base: S): CountingStore<S> {
  let calls: Record<string, number> = {}
  const store = new Proxy(base, {
    get (target, property) {
      const value: unknown = Reflect.get(target, property, target)
      if (typeof value !== 'function' || typeof property !== 'string') return value
      const method = value as (...args: unknown[]) => unknown
      return (...args: unknown[]) => {
        calls[property] = (calls[property] ?? 0) + 1
        return method.apply(target, args)
      }
    }
  })
  return {
    store,
    calls: () => ({ ...calls }),
    total: () => Object.values(calls).reduce((sum, n) => sum + n, 0),
    reset: () => { calls = {} }
  }
}
