/**
 * The lease-boundary situations, shared by the app (its routes) and the harness (its
 * clients, the reconciler's policy, the checker's counters). Each scenario's route has a lease
 * much shorter than its handler, and some a ttl shorter than the handler too, set per route
 * (`config: { idempotency: { lease, ttl } }`); everything else in the app keeps the run's lease.
 *
 *   slow             handler 0.5–1.5 s under a 300 ms lease; a duplicate arrives past the lease
 *   slow-ttl         handler 1.5–2 s under a 300 ms lease and a 1 s ttl; a duplicate arrives past the ttl
 *   abandon          handler 1–1.5 s; its client disconnects at 100–250 ms and retries at once, every 150–300 ms
 *   stream           a body streamed over about 1 s under a 300 ms lease; a duplicate arrives mid-stream
 *   stream-paused    a 512 KiB streamed body whose client stops reading, then leaves and retries
 *   steps-force      two steps 1.2 s apart; between them the harness force-releases the key and retries
 *   steps-partition  the same, but the harness cuts the owner's instance from the database and
 *                    retries on another instance, which takes the key over
 *   held             a step completes, then the handler marks the failure indeterminate and fails:
 *                    the key is held for the reconciler, which leaves it longer than the 1 s ttl
 *   wait-lease       a handler of 600–900 ms on a route with `wait` (2 s); duplicates arrive on the
 *                    other instances and wait for it: woken by the store's settlement notice on the
 *                    instance without a pre-filter (whose listener connection is killed while they
 *                    wait, in three operations of four), by the pre-filter's copy on the other
 *   wait-atomic      the same in atomic mode: its duplicates hold no connection while they wait
 *   atomic-duplicate atomic mode without `wait` (a claim tries its key's lock, never waits for
 *                    another transaction): the handler holds its transaction 300–500 ms on the
 *                    instance without a pre-filter, and duplicates arrive meanwhile on that
 *                    instance and on another (409 at once, or the replay after the commit)
 */

export const SCENARIOS = ['slow', 'slow-ttl', 'abandon', 'stream', 'stream-paused', 'steps-force', 'steps-partition', 'held', 'atomic-duplicate', 'wait-lease', 'wait-atomic'] as const
export type Scenario = typeof SCENARIOS[number]

/** The lease of every scenario route: a third of it is the renewal interval. */
export const SCENARIO_LEASE_MS = 300
/** The wait-lease and wait-atomic routes' `wait` and lease: longer than their handlers, so duplicates wait for the settlement. */
export const WAITING_MS = 2_000
/** The ttl of the short-retention routes (slow-ttl, held). */
export const SHORT_TTL_MS = 1_000
/** The reconciler leaves a held record of the `held` scenario at least this long after it was created. */
export const HELD_MIN_MS = 2_500

export interface ScenarioRoute {
  readonly path: string
  /** atomic: the effect is a ledger row in the claim's transaction; lease: a provider charge. */
  readonly mode: 'atomic' | 'lease'
  readonly leaseMs: number
  /** null: the app's default ttl. */
  readonly ttlMs: number | null
  /** The route's `wait`; absent: the app's. */
  readonly waitMs?: number
}

/** Route per scenario: the two stream and the two steps scenarios share theirs. */
export const SCENARIO_ROUTES: Readonly<Record<Scenario, ScenarioRoute>> = {
  slow: { path: '/scenarios/slow', mode: 'lease', leaseMs: SCENARIO_LEASE_MS, ttlMs: null },
  'slow-ttl': { path: '/scenarios/slow-ttl', mode: 'lease', leaseMs: SCENARIO_LEASE_MS, ttlMs: SHORT_TTL_MS },
  abandon: { path: '/scenarios/abandon', mode: 'lease', leaseMs: SCENARIO_LEASE_MS, ttlMs: null },
  stream: { path: '/scenarios/stream', mode: 'lease', leaseMs: SCENARIO_LEASE_MS, ttlMs: null },
  'stream-paused': { path: '/scenarios/stream', mode: 'lease', leaseMs: SCENARIO_LEASE_MS, ttlMs: null },
  'steps-force': { path: '/scenarios/steps', mode: 'lease', leaseMs: SCENARIO_LEASE_MS, ttlMs: null },
  'steps-partition': { path: '/scenarios/steps', mode: 'lease', leaseMs: SCENARIO_LEASE_MS, ttlMs: null },
  held: { path: '/scenarios/held', mode: 'lease', leaseMs: SCENARIO_LEASE_MS, ttlMs: SHORT_TTL_MS },
  // The lease means nothing to an atomic claim (its transaction holds the key); `wait: 0` is the point.
  'atomic-duplicate': { path: '/scenarios/atomic-duplicate', mode: 'atomic', leaseMs: SCENARIO_LEASE_MS, ttlMs: null, waitMs: 0 },
  'wait-lease': { path: '/scenarios/wait-lease', mode: 'lease', leaseMs: WAITING_MS, ttlMs: null, waitMs: WAITING_MS },
  'wait-atomic': { path: '/scenarios/wait-atomic', mode: 'atomic', leaseMs: WAITING_MS, ttlMs: null, waitMs: WAITING_MS }
}

/** What a scenario operation sends besides amount and currency: the handler's timings. */
export interface ScenarioParameters {
  readonly delayMs?: number
  readonly pauseMs?: number
  readonly chunks?: number
  readonly chunkBytes?: number
  readonly intervalMs?: number
}

/** Keys of scenario operations start with the scenario's name: the reconciler's policy tells them apart. */
export function scenarioOfKey (key: string): Scenario | null {
  for (const scenario of SCENARIOS) if (key.startsWith(`${scenario}-`)) return scenario
  return null
}

/**
 * The streamed body, in its parts: the same JSON as every payment answer, with a padding member
 * made of `chunks` × `chunkBytes` bytes, so a re-execution streams byte-identical content.
 */
export function streamedParts (head: { mode: string, scope: string, key: string, amount: number, ref: string }, chunks: number, chunkBytes: number): Buffer[] {
  const open = JSON.stringify(head).slice(0, -1) + ',"pad":"'
  const parts = [Buffer.from(open)]
  for (let i = 0; i < chunks; i++) parts.push(Buffer.alloc(chunkBytes, 'x'))
  parts.push(Buffer.from('"}'))
  return parts
}
