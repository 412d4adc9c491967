import type { ClaimRequest, IdempotencyStore, Lease } from '../../lib/core/store.js'
import { realNow, type EvidenceLog } from './evidence.js'
import type { Scenario } from './scenario-routes.js'

/**
 * Planted bugs (`--plant=NAME`): old behaviours of the plugin, emulated in the harness's app (never
 * in lib/), to see the harness catch each one end to end. Each names the scenario that reaches it
 * and the violation the run must report.
 *
 * - provider-key-per-attempt: a fresh provider key on every attempt, so a re-run charges twice.
 * - abandon-stops-renewal: once the app saw a key's client disconnect, `renew`
 *   returns true without renewing, as `abandon()` stopped renewal.
 * - stream-stops-renewal (case 2): the same once the response started (onSend), as renewal stopped
 *   at the start of onSend while a stream is recorded only at its end.
 * - renew-keeps-ttl (case 3): `renew` extends the lease but not `expires_at`, as the memory store
 *   did, so an in-progress record expires under a renewing owner.
 * - held-expires (case 4): a held record past its ttl is reclaimed as a fresh one (the claim first
 *   deletes it), discarding its recorded steps.
 * - step-before-fence (case 5): the handler runs a step's effect first and only then calls
 *   `step(name, () => result)`, as step() ran `fn` before its fenced save.
 */
export const PLANTS = [
  'provider-key-per-attempt',
  'abandon-stops-renewal',
  'stream-stops-renewal',
  'renew-keeps-ttl',
  'held-expires',
  'step-before-fence'
] as const
export type Plant = typeof PLANTS[number]

/** The scenario that reaches each plant, and the violation kind its run must report. */
export const PLANT_TARGETS: Readonly<Record<Plant, { readonly scenario: Scenario | null, readonly violation: string }>> = {
  'provider-key-per-attempt': { scenario: null, violation: 'duplicate-effect' },
  'abandon-stops-renewal': { scenario: 'abandon', violation: 'concurrent-execution' },
  'stream-stops-renewal': { scenario: 'stream', violation: 'concurrent-execution' },
  'renew-keeps-ttl': { scenario: 'slow-ttl', violation: 'concurrent-execution' },
  'held-expires': { scenario: 'held', violation: 'execution-while-held' },
  'step-before-fence': { scenario: 'steps-force', violation: 'unfenced-step' }
}

/** Keys (recordId) whose renewals the app's planted bug now skips (abandon- and stream-stops-renewal). */
export type StoppedRenewals = Set<string>

const idOf = (scope: string, key: string): string => JSON.stringify([scope, key])

/** Runs one statement with `$n` parameters on the app's own client (database.ts); the rows it affected. */
export type RunStatement = (text: string, values: ReadonlyArray<string | number>) => Promise<number>

/**
 * The store with the plant's behaviour in front of it: plugin → planted store → logged store →
 * Postgres store. A skipped renewal reaches no store and so is not logged (nothing happened there);
 * the planted SQL is logged as what it did. It runs on the client the store runs on, so a plant
 * works the same on either.
 */
export function plantedStore<S extends IdempotencyStore> (store: S, plant: Plant | null, run: RunStatement, log: EvidenceLog, stopped: StoppedRenewals): S {
  if (plant === null || plant === 'provider-key-per-attempt' || plant === 'step-before-fence') return store
  const transactional = new Set<string>()
  const overrides: Record<string, unknown> = {}

  if (plant === 'abandon-stops-renewal' || plant === 'stream-stops-renewal') {
    overrides.renew = async (lease: Lease, leaseMs: number): Promise<boolean> => {
      if (stopped.has(idOf(lease.scope, lease.key))) return true
      return await store.renew(lease, leaseMs)
    }
  }

  if (plant === 'renew-keeps-ttl') {
    overrides.claimInTransaction = async (request: Parameters<NonNullable<IdempotencyStore['claimInTransaction']>>[0]) => {
      const result = await (store.claimInTransaction as NonNullable<IdempotencyStore['claimInTransaction']>)(request)
      if (result.outcome === 'acquired') transactional.add(result.lease.token)
      return result
    }
    overrides.renew = async (lease: Lease, leaseMs: number): Promise<boolean> => {
      if (transactional.has(lease.token)) return await store.renew(lease, leaseMs)
      const start = realNow()
      let ok: boolean | null = null
      try {
        const count = await run(`
          UPDATE idempotency_records SET lease_expires_at = now() + $1::float8 * interval '1 millisecond'
          WHERE scope = $2 AND key = $3 AND owner_token = $4::uuid AND state = 'in_progress'`, [leaseMs, lease.scope, lease.key, lease.token])
        ok = count === 1
        return ok
      } finally {
        log({ ev: 'renew', end: Math.round(realNow()), scope: lease.scope, key: lease.key, token: lease.token, ok }, start)
      }
    }
  }

  if (plant === 'held-expires') {
    overrides.claim = async (request: ClaimRequest): Promise<Awaited<ReturnType<IdempotencyStore['claim']>>> => {
      const deleted = await run(`
        DELETE FROM idempotency_records
        WHERE scope = $1 AND key = $2 AND state = 'in_progress' AND indeterminate
          AND created_at <= now() - $3::float8 * interval '1 millisecond'`, [request.scope, request.key, request.ttlMs])
      if (deleted > 0) log({ ev: 'plant', scope: request.scope, key: request.key, what: 'deleted a held record past its ttl before the claim' })
      return await store.claim(request)
    }
  }

  return new Proxy(store, {
    get (target, property, receiver) {
      if (typeof property === 'string' && Object.hasOwn(overrides, property)) return overrides[property]
      const value = Reflect.get(target, property, receiver) as unknown
      return typeof value === 'function' ? (value as (...args: unknown[]) => unknown).bind(target) : value
    }
  })
}

export function markStopped (stopped: StoppedRenewals, scope: string, key: string): void {
  stopped.add(idOf(scope, key))
}
