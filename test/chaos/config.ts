import type { WorkloadSettings } from './clients.js'
import { PG_CLIENTS, type PgClient } from './database.js'
import { BOUNDARIES, BOUNDARY_SCENARIOS, type Boundary } from './executions.js'
import { PLANTS, type Plant } from './plants.js'
import type { QueueSettings } from './queue.js'
import { SCENARIOS, type Scenario } from './scenario-routes.js'

/**
 * The run's parameters: `tsx test/chaos/run.ts [--quick] [--duration=SECONDS] [--seed=N]
 * [--redis=standalone|cluster|both] [--instances=N] [--report=FILE] [--plant=NAME]
 * [--scenario=NAME[,NAME...]] [--client=postgres|pg]`.
 *
 * `--client=` picks the PostgreSQL client the apps and the reconciler worker run the store on:
 * postgres.js (the default) or a node-postgres Pool (database.ts).
 *
 * Full mode (the default) keeps faults coming for `duration` seconds (300), with at least 10,000
 * operations, every fault kind at least 10 times and every lease and queue boundary crossed at
 * least 50 times (a shorter --duration scales them down); quick mode (CI) runs 30 s with every kind
 * and every boundary at least once. Both run the queue door (queue.ts) beside the HTTP load.
 *
 * `--scenario=` is the targeted mode (the planted-bug tests): only the named lease-boundary
 * scenarios run, one operation every 500 ms, with no other operations, no queue door and no
 * faults, and only their own boundaries must be crossed (at least once).
 */
export interface ChaosConfig {
  readonly mode: 'full' | 'quick'
  readonly seed: number
  /** The client of the store under test (database.ts). */
  readonly client: PgClient
  /** Seconds of load with faults. */
  readonly durationS: number
  /** `both`: the first half on the standalone Redis, then a rolling restart onto the 3-master cluster. */
  readonly redis: 'standalone' | 'cluster' | 'both'
  readonly instances: number
  /** Scheduled injections of each fault kind (but worker-kill). */
  readonly faultsPerKind: number
  /** Scheduled worker-kill injections: each feeds the queue door's takeover boundary, so there are more of them. */
  readonly workerKills: number
  /** Effective injections of each kind the run must reach, or it fails (a fault that never bit proves nothing). */
  readonly minEffectivePerKind: number
  readonly minOperations: number
  /** Crossings of each lease boundary the run must reach, or it fails (exit 2). */
  readonly minCrossings: Readonly<Record<Boundary, number>>
  /** `--scenario=`: the targeted mode's scenarios; null in the full and quick modes (all of them, with faults). */
  readonly targeted: readonly Scenario[] | null
  readonly workload: WorkloadSettings
  /** The queue door (queue.ts): job workers and an at-least-once queue; null in the targeted mode. */
  readonly queue: QueueSettings | null
  readonly leaseMs: number
  readonly waitMs: number
  readonly storeTimeoutMs: number
  /** How long the drain may take to bring every operation to an answer once the faults stopped. */
  readonly drainS: number
  readonly reportFile: string | null
  /** A bug planted in the app, to see the harness catch it end to end (plants.ts lists them). */
  readonly plant: Plant | null
}

export function parseArgs (argv: readonly string[]): ChaosConfig {
  const flags = new Map<string, string>()
  for (const arg of argv) {
    const match = /^--([a-z-]+)(?:=(.*))?$/.exec(arg)
    if (match === null) throw new Error(`chaos: unknown argument ${arg}`)
    flags.set(match[1] as string, match[2] ?? 'true')
  }
  const known = new Set(['quick', 'duration', 'seed', 'redis', 'instances', 'report', 'plant', 'scenario', 'client'])
  for (const name of flags.keys()) if (!known.has(name)) throw new Error(`chaos: unknown option --${name}`)

  const quick = flags.get('quick') === 'true'
  const durationS = integer(flags.get('duration'), quick ? 30 : 300, '--duration', 10)
  const seed = integer(flags.get('seed'), Date.now() % 2_147_483_647, '--seed', 0)
  const targetedFlag = flags.get('scenario')
  const targeted = targetedFlag === undefined ? null : targetedFlag.split(',') as Scenario[]
  // Targeted runs are short and quiet: no rolling restart onto the cluster halfway.
  const redis = flags.get('redis') ?? (targeted !== null ? 'standalone' : 'both')
  if (redis !== 'standalone' && redis !== 'cluster' && redis !== 'both') throw new Error(`chaos: --redis must be standalone, cluster or both; received ${redis}`)
  const instances = integer(flags.get('instances'), 3, '--instances', 2)
  const client = (flags.get('client') ?? 'postgres') as PgClient
  if (!PG_CLIENTS.includes(client)) throw new Error(`chaos: --client takes ${PG_CLIENTS.join(' or ')}; received ${client}`)
  const plant = (flags.get('plant') ?? null) as Plant | null
  if (plant !== null && !PLANTS.includes(plant)) throw new Error(`chaos: --plant takes one of ${PLANTS.join(', ')}; received ${plant}`)
  for (const scenario of targeted ?? []) {
    if (!SCENARIOS.includes(scenario)) throw new Error(`chaos: --scenario takes names from ${SCENARIOS.join(', ')}; received ${scenario}`)
  }
  // Full mode: 12,000 operations over the run (at 300 s, 40 a second), at most 60 a second.
  const ratePerSecond = targeted !== null ? 0 : quick ? 20 : Math.min(60, Math.max(40, Math.ceil(12_000 / durationS)))
  // At 300 s, one scenario operation every 300 ms: about 90 of each scenario (180 of steps-partition
  // and of atomic-duplicate, twice a turn), for 50 crossings of each boundary with a margin.
  // A quick run shares its 30 s and two cores with the queue door's workers: one every 500 ms, so
  // the rarest boundary (atomic-duplicate's claim that waited for the table's lock) is still crossed.
  const scenarioIntervalMs = targeted !== null ? 500 : quick ? 500 : 300
  const scenarios = targeted ?? SCENARIOS
  // A planted bug lives in the app instances (plants.ts): a planted run leaves the queue door out, so
  // its faults (a dropped provider reply, a kill) land on the requests that carry the plant.
  const queueDoor = targeted === null && plant === null
  const minCrossings = Object.fromEntries(BOUNDARIES.map((boundary) => {
    const reached = BOUNDARY_SCENARIOS[boundary].some((scenario) => scenario === 'queue' ? queueDoor : scenarios.includes(scenario))
    const min = !reached ? 0 : targeted !== null || quick ? 1 : Math.max(1, Math.round(50 * durationS / 300))
    return [boundary, min]
  })) as Record<Boundary, number>
  // A scheduled fault can miss (nothing in flight to kill, a probe cut by an overlapping restart):
  // more are scheduled than the minimum that must bite. At 300 s: 14 of each, 10 must bite.
  const faultsPerKind = quick ? 2 : Math.max(2, Math.round(durationS / 21))
  // One worker kill every 6 s (50 at 300 s): each takes its jobs mid-run with it (two on average),
  // and most of those are then taken over by a redelivery (50 required). A quick run has 5.
  const workerKills = !queueDoor ? 0 : quick ? 5 : Math.max(2, Math.round(durationS / 6))

  return {
    mode: quick ? 'quick' : 'full',
    seed,
    client,
    durationS,
    redis,
    instances,
    faultsPerKind: targeted !== null ? 0 : faultsPerKind,
    workerKills,
    minEffectivePerKind: targeted !== null ? 0 : quick ? 1 : Math.max(1, faultsPerKind - 4),
    // 10,000 in a full run of 300 s or more; 85% of what was scheduled in a shorter one.
    minOperations: targeted !== null ? 1 : quick ? 100 : Math.min(10_000, Math.floor(0.85 * ratePerSecond * durationS)),
    minCrossings,
    targeted,
    workload: {
      scopes: ['acct-alpha', 'acct-beta'],
      ratePerSecond,
      maxConcurrent: quick ? 64 : 256,
      attemptTimeoutMs: 3_000,
      maxAttempts: 8,
      atomicShare: 0.5,
      reuseShare: 0.05,
      sharedKeyShare: 0.1,
      stormShare: 0.1,
      replayCheckShare: 0.25,
      scenarios,
      scenarioIntervalMs
    },
    // At 300 s, 1,200 jobs: about 120 slow ones (redelivered while they run), 180 delivered to two
    // workers at once (some meet a fault) and 120 delivered again after their acknowledgement, for 50 crossings of each
    // queue boundary with a margin. Three workers, so that two are up for a duplicate while the
    // third restarts after a kill; each runs 8 at once. The visibility timeout is longer than the
    // lease, so a killed worker's key has lapsed when most of its redeliveries come.
    queue: !queueDoor
      ? null
      : {
          workers: 3,
          ratePerSecond: 4,
          concurrency: 8,
          visibilityMs: 1_500,
          leaseMs: 1_000,
          waitMs: 400,
          retryAfterMs: 250,
          storeTimeoutMs: 2_000,
          slowShare: 0.1,
          slowDelayMs: [1_600, 2_400],
          duplicateShare: 0.15,
          lateDuplicateShare: 0.1,
          reuseShare: 0.05,
          scopes: ['acct-alpha', 'acct-beta']
        },
    leaseMs: 2_000,
    waitMs: 250,
    storeTimeoutMs: 2_000,
    drainS: targeted !== null ? 15 : quick ? 20 : 60,
    reportFile: flags.get('report') ?? null,
    plant
  }
}

function integer (value: string | undefined, fallback: number, name: string, min: number): number {
  if (value === undefined) return fallback
  const n = Number(value)
  if (!Number.isInteger(n) || n < min) throw new Error(`chaos: ${name} takes an integer >= ${min}; received ${value}`)
  return n
}
