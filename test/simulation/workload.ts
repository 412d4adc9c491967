import type { Random } from '../chaos/random.js'
import type { FaultRates, Outage } from './network.js'

/*
 * What one run does, drawn from its seed: which instances, how faulty the network is, and the
 * requests (when each arrives, on which instance and route, with which key and body, whether its
 * client leaves, how long its handler works and how it ends).
 */

/** The simulated routes; every instance has all of them (world.ts gives their options). */
export const ROUTES = ['/l/plain', '/l/wait', '/l/timeout', '/l/rule', '/l/slow', '/l/steps', '/a/plain', '/a/wait', '/a/timeout'] as const
/**
 * The job door: runs through a job runner instead of a route (world.ts gives their runners and
 * options). `/j/app` runs through `fastify.idempotency.run()`, the others through runners of their own.
 */
export const JOB_ROUTES = ['/j/app', '/j/wait', '/j/steps', '/j/slow', '/ja/plain', '/ja/wait'] as const
export type Route = typeof ROUTES[number] | typeof JOB_ROUTES[number]

export const isAtomic = (route: Route): boolean => route.startsWith('/a/') || route.startsWith('/ja/')
export const isJob = (route: Route): boolean => route.startsWith('/j')

/** The share of keys that go through the job door. */
const JOB_SHARE = 0.35

/** How the handler ends. `ok`, `indeterminate` and `unsendable` have an effect (a charge); the others none. */
export type HandlerEnd = 'ok' | 'throw' | 'fail-500' | 'indeterminate' | 'unsendable'

export const EFFECTFUL: ReadonlySet<HandlerEnd> = new Set(['ok', 'indeterminate', 'unsendable'])

export interface Plan {
  readonly id: number
  readonly instance: number
  readonly route: Route
  readonly key: string
  /** The body's amount: a duplicate with another amount is a different request (422). */
  readonly amount: number
  readonly arriveAt: number
  /** When the client goes away (null: it waits for the answer). */
  readonly abortAfter: number | null
  /** Virtual ms of handler work. */
  readonly work: number
  readonly end: HandlerEnd
  /** The last request of each key, sent once the network has healed: its answer must be definite. */
  readonly probe: boolean
}

export interface Workload {
  readonly instances: number
  readonly rates: FaultRates
  /** A window in which the store refuses every call but renewals, or null. */
  readonly outage: Outage | null
  readonly plans: Plan[]
}

const LEVELS: readonly FaultRates[] = [
  { slow: 0, lost: 0, failBefore: 0, failAfter: 0 },
  { slow: 0.08, lost: 0.04, failBefore: 0.08, failAfter: 0.04 },
  { slow: 0.15, lost: 0.08, failBefore: 0.15, failAfter: 0.08 }
]

function handlerEnd (random: Random): HandlerEnd {
  const r = random()
  if (r < 0.6) return 'ok'
  if (r < 0.72) return 'throw'
  if (r < 0.8) return 'fail-500'
  if (r < 0.92) return 'indeterminate'
  return 'unsendable'
}

/** When the client leaves, as drawn; a job has no client to leave (the draw is made all the same, to keep the stream as it is). */
function leavesAfter (route: Route, drawn: number | null): number | null {
  return isJob(route) ? null : drawn
}

export function workload (random: Random): Workload {
  const instances = random.int(2, 3)
  const level = random()
  const rates = LEVELS[level < 0.25 ? 0 : level < 0.65 ? 1 : 2] as FaultRates
  const plans: Plan[] = []
  const keys = random.int(1, 3)
  // Drawn from a stream of their own, so the routes' draws (and what a seed means for them) stay as they are.
  const doors = random.fork('doors')
  for (let k = 0; k < keys; k++) {
    const key = `k${k}`
    const picked: Route = random.pick(ROUTES)
    const route = doors.chance(JOB_SHARE) ? doors.pick(JOB_ROUTES) : picked
    const base = random.int(0, 300)
    const count = random.int(1, 4)
    for (let i = 0; i < count; i++) {
      plans.push({
        id: plans.length,
        instance: random.int(0, instances - 1),
        route,
        key,
        amount: i > 0 && random.chance(0.15) ? 2 : 1,
        arriveAt: i === 0 ? base : base + random.int(0, 700),
        abortAfter: leavesAfter(route, random.chance(0.15) ? random.int(0, 300) : null),
        work: random.chance(0.2) ? 0 : random.int(1, 350),
        end: handlerEnd(random),
        probe: false
      })
    }
  }
  const from = random.int(100, 800)
  const outage = random.chance(0.3) ? { from, until: from + random.int(200, 1200) } : null
  return { instances, rates, outage, plans }
}

/** One probe per key, the same request as its first, for after the network has healed. */
export function probes (plans: readonly Plan[], random: Random, instances: number, arriveAt: number): Plan[] {
  const firsts = new Map<string, Plan>()
  for (const plan of plans) if (!firsts.has(plan.key)) firsts.set(plan.key, plan)
  let id = plans.length
  return [...firsts.values()].map((first) => ({
    ...first,
    id: id++,
    instance: random.int(0, instances - 1),
    arriveAt,
    abortAfter: null,
    work: 1,
    end: 'ok' as const,
    probe: true
  }))
}
