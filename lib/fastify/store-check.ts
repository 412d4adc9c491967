import type { FastifyInstance } from 'fastify'
import { StoreNotReadyError } from '../core/errors.js'
import type { IdempotencyStore } from '../core/store.js'
import { bounded } from '../core/timeout.js'
import { bootWarning, WARNING_CODES } from './warnings.js'

/**
 * Asks the store, once the app is ready to boot, whether it can serve (`IdempotencyStore.check`):
 * a store that cannot (the PostgreSQL driver without its tables) fails `ready()` and `listen()`
 * with its `StoreNotReadyError`, instead of booting an app whose every protected request answers
 * 503 while Fastify's default `logger: false` prints nothing. A store that could not be checked
 * (its database unreachable at boot, or no answer within `storeTimeout`) does not stop the boot:
 * the outage may be brief, and requests answer 503 meanwhile; a coded warning says so.
 *
 * The method is called on the object the application passed, never on a copy, so a wrapper (a
 * Proxy, a spread store) sees the call like every other.
 */
export function checkStoreWhenReady (fastify: FastifyInstance, store: IdempotencyStore, timeoutMs: number): void {
  if (typeof store.check !== 'function') return
  fastify.addHook('onReady', async function checkIdempotencyStore () {
    try {
      await bounded('check', timeoutMs, async () => { await store.check?.() })
    } catch (err) {
      if (isNotReady(err)) throw err
      bootWarning(fastify, WARNING_CODES.storeUnchecked, 'fastify-idempotency: the store could not be checked at boot ' +
        `(${reason(err)}); protected requests answer 503 while it fails.`)
    }
  })
}

/** The package's own error, or one with its code (a driver built against another copy of the package). */
function isNotReady (err: unknown): boolean {
  return err instanceof StoreNotReadyError || (err as { code?: unknown } | null)?.code === 'FST_IDEMPOTENCY_STORE_NOT_READY'
}

/** The error's message, without the package's own prefix (the warning has it already). */
function reason (err: unknown): string {
  return (err instanceof Error ? err.message : String(err)).replace(/^fastify-idempotency: /, '')
}
