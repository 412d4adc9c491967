import type { FastifyRequest } from 'fastify'
import { stateOf } from '../../lib/fastify/request-state.js'
import type { IdempotencyStore, Lease } from '../../lib/core/store.js'
import type { Trace } from './trace.js'
import type { Route } from './workload.js'

/*
 * Planted bugs: behaviours the plugin once had, emulated between the plugin and the simulated store
 * (never in lib/), to show that the simulation finds, within the seeds a CI run tries, what
 * enumerating cases had missed. Each names the violations its runs must report.
 *
 * - rule-throw-releases: a `record` rule that throws releases the key after the handler answered
 *   (its effect happened), so a retry runs the operation again.
 * - late-claim-kept: a claim that lands after another answer went out (a handlerTimeout) is kept
 *   and renewed, and nothing ever settles it: the key stays in progress for good.
 * - complete-retries-stop-renewal: after three failed attempts to record the response, the owner
 *   gives up and stops renewing its lease, which lapses under a live owner: a retry runs the
 *   operation again.
 */
export const PLANTS = ['rule-throw-releases', 'late-claim-kept', 'complete-retries-stop-renewal'] as const
export type Plant = typeof PLANTS[number]

/** The violations a run with the plant must report (any of them). */
export const PLANT_VIOLATIONS: Readonly<Record<Plant, readonly string[]>> = {
  'rule-throw-releases': ['double-execution', 'success-not-recorded'],
  'late-claim-kept': ['stuck-in-progress', 'never-settled', 'no-definite-answer'],
  'complete-retries-stop-renewal': ['double-execution']
}

export interface PlantContext {
  readonly flightOf: (request: number | null) => { readonly route: Route, readonly request: FastifyRequest | null, readonly handlerStarted: boolean } | null
  readonly requestOf: () => number | null
  readonly trace: Trace
  readonly lease: number
}

export function planted (store: IdempotencyStore, plant: Plant | null, context: PlantContext): IdempotencyStore {
  if (plant === null) return store
  const { flightOf, requestOf, trace, lease } = context
  switch (plant) {
    case 'rule-throw-releases':
      return {
        ...store,
        complete: (given, response, ttl) => {
          if (flightOf(requestOf())?.route !== '/l/rule') return store.complete(given, response, ttl)
          trace.log(`plant: the throwing rule releases ${given.key} instead of recording it`)
          return store.release(given)
        }
      }
    case 'late-claim-kept': {
      const keep = (given: Lease): boolean => {
        const request = flightOf(requestOf())?.request ?? null
        if (request === null || stateOf(request)?.lifecycle.phase !== 'preempted') return false
        trace.log(`plant: the late claim of ${given.key} is kept and renewed for good`)
        setInterval(() => { Promise.resolve(store.renew(given, lease)).catch(() => {}) }, Math.floor(lease / 3))
        return true
      }
      return {
        ...store,
        release: (given) => keep(given) ? true : store.release(given),
        renew: (given, ms) => ms === 0 && keep(given) ? true : store.renew(given, ms)
      }
    }
    case 'complete-retries-stop-renewal': {
      const attempts = new Map<string, number>()
      const stopped = new Set<string>()
      return {
        ...store,
        complete: (given, response, ttl) => {
          if (stopped.has(given.token)) return Promise.reject(new Error('plant: the owner gave up recording'))
          const attempt = (attempts.get(given.token) ?? 0) + 1
          attempts.set(given.token, attempt)
          const answer = Promise.resolve(store.complete(given, response, ttl))
          if (attempt < 3) return answer
          // The third attempt: if it fails (or does not answer within the shortest storeTimeout),
          // the owner gives up and its renewals stop.
          let answered = false
          answer.then(() => { answered = true }, () => {
            trace.log(`plant: ${given.key}'s owner gave up after three failed records; renewal stops`)
            stopped.add(given.token)
          })
          setTimeout(() => {
            if (answered || stopped.has(given.token)) return
            trace.log(`plant: ${given.key}'s owner gave up after three unanswered records; renewal stops`)
            stopped.add(given.token)
          }, 60)
          return answer
        },
        renew: (given, ms) => stopped.has(given.token) ? true : store.renew(given, ms)
      }
    }
  }
}
