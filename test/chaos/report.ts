import type { CheckResult, Violation } from './checker.js'
import type { ChaosConfig } from './config.js'
import { formatDeaths } from './deaths.js'
import { BOUNDARIES, QUEUE_BOUNDARIES, type Boundary } from './executions.js'
import { FAULT_KINDS, type FaultKind } from './faults.js'
import type { Crash, FaultEvent } from './history.js'
import type { QueueStats } from './queue.js'
import type { ReconcilerStats } from './reconciler.js'

/** The run's outcome as the runner prints it and writes it to `--report` (JSON) for the test. */
export interface ChaosReport {
  readonly mode: ChaosConfig['mode']
  readonly seed: number
  /** The client the apps and the reconciler ran the store on. */
  readonly client: ChaosConfig['client']
  /** That client's library and version, as installed (`node-postgres 8.23.1`). */
  readonly clientVersion: string
  readonly durationS: number
  readonly redis: ChaosConfig['redis']
  readonly instances: number
  readonly elapsedS: number
  readonly stats: CheckResult['stats']
  readonly throttled: number
  readonly providerCalls: number
  readonly providerReplays: number
  /** Keys whose record stayed in progress after their client's 2xx, completed by the drain's retry. */
  readonly settledByDrain: number
  /** The store's reconciler, when the plugin has one: passes and what they resolved. */
  readonly reconciler: ReconcilerStats | null
  /** Per kind: scheduled injections and how many of them bit. */
  readonly faults: Readonly<Record<FaultKind, { readonly injected: number, readonly effective: number }>>
  readonly faultEvents: readonly FaultEvent[]
  /** Processes that died without being killed (each restarted by its supervisor): process deaths, target 0 (deaths.ts). */
  readonly crashes: readonly Crash[]
  /** Kinds below the run's minimum of effective injections; the run fails if any. */
  readonly faultsMissing: readonly FaultKind[]
  /** Crossings of each lease boundary the run had to reach, and the boundaries below that; the run fails if any. */
  readonly minCrossings: Readonly<Record<Boundary, number>>
  readonly boundariesMissing: readonly Boundary[]
  /** Operations of each lease-boundary scenario. */
  readonly scenarioOperations: Readonly<Record<string, number>>
  /** The queue door's jobs and deliveries by reason; null when it did not run (targeted mode). */
  readonly queue: QueueStats | null
  /** `--scenario=`: the targeted run's scenarios (no faults, no other operations). */
  readonly targeted: ChaosConfig['targeted']
  readonly plant: ChaosConfig['plant']
  /** Force releases and partitions the scenarios made. */
  readonly interventions: number
  readonly violations: readonly Violation[]
  /** Where the instances', provider's and services' logs were left (only kept when the run failed). */
  readonly logDir: string | null
}

export function faultCounts (events: readonly FaultEvent[]): ChaosReport['faults'] {
  const counts = Object.fromEntries(FAULT_KINDS.map((kind) => [kind, { injected: 0, effective: 0 }])) as Record<FaultKind, { injected: number, effective: number }>
  for (const event of events) {
    const count = counts[event.kind as FaultKind]
    if (count === undefined) continue
    count.injected++
    if (event.effective) count.effective++
  }
  return counts
}

const n = (value: number): string => value.toLocaleString('en-US')

/** How the summary names each boundary. */
const BOUNDARY_LABELS: Readonly<Record<Boundary, string>> = {
  'retry-while-abandoned-handler-ran': 'retries that arrived while a disconnected client\'s handler still ran',
  'stream-outlived-lease': 'streams that outlived their lease',
  'handler-outlived-ttl': 'handlers that outlived a short ttl',
  'held-past-ttl': 'held records retried past their ttl',
  'partitioned-owner-taken-over': 'takeovers of a partitioned owner still running',
  'step-after-takeover': 'steps attempted after a takeover or force release',
  'atomic-claim-found-key-busy': 'atomic claims that found their key\'s lock held by the original\'s transaction (in progress at once)',
  'table-lock-not-a-duplicate': 'atomic claims that waited for the records table\'s lock, then ran (the lock was not a duplicate\'s)',
  'waiter-answered-across-instances': 'duplicates that waited on another instance and got the replay when the original completed',
  'atomic-waiter-answered-across-instances': 'of those, in atomic mode',
  'waiter-outlived-listener-loss': 'of those, on an instance whose settlement listener was killed while they waited',
  'job-taken-over-after-kill': 'jobs whose worker was killed mid-run, then taken over by a redelivery',
  'job-redelivered-while-running': 'redeliveries while the original still ran (OperationInProgressError or a waited replay)',
  'job-delivered-to-two-workers': 'deliveries to two workers at once (one ran, the other got OperationInProgressError or the replay)',
  'job-replayed-after-completion': 'deliveries after completion answered with the recorded value'
}

export function formatSummary (report: ChaosReport): string {
  const s = report.stats
  const outcomes = Object.entries(s.outcomes).sort((a, b) => b[1] - a[1]).map(([name, count]) => `${name} ${n(count)}`).join(', ')
  const redis = report.redis === 'both' ? 'standalone Redis, then (rolling restart) a 3-master Redis Cluster' : report.redis === 'cluster' ? '3-master Redis Cluster' : 'standalone Redis'
  const faults = FAULT_KINDS.map((kind) => `${kind} ${report.faults[kind].effective}/${report.faults[kind].injected}`).join(', ')
  const injected = FAULT_KINDS.reduce((sum, kind) => sum + report.faults[kind].injected, 0)
  const e = s.executions
  const r = e.reexecutions
  const scenarios = Object.entries(report.scenarioOperations).map(([name, count]) => `${name} ${n(count)}`).join(', ')
  const minimum = Math.max(...BOUNDARIES.map((boundary) => report.minCrossings[boundary]))
  const crossed = BOUNDARIES.filter((boundary) => !QUEUE_BOUNDARIES.includes(boundary) && (report.minCrossings[boundary] > 0 || e.boundaries[boundary] > 0))
    .map((boundary) => `${BOUNDARY_LABELS[boundary]} ${n(e.boundaries[boundary])}`).join(', ')
  const queueCrossed = QUEUE_BOUNDARIES.map((boundary) => `${BOUNDARY_LABELS[boundary]} ${n(e.boundaries[boundary])}`).join(', ')
  const queueMinimum = Math.max(...QUEUE_BOUNDARIES.map((boundary) => report.minCrossings[boundary]))
  const q = report.queue
  const what = report.targeted === null
    ? `${report.durationS} s of faults`
    : `targeted (${report.targeted.join(', ')}): ${report.durationS} s, no faults`
  const lines = [
    `chaos ${report.targeted === null ? report.mode : 'targeted'} run, seed ${report.seed}${report.plant === null ? '' : `, PLANTED BUG ${report.plant}`}: ${what}, ${report.instances} instances (the last without the Redis pre-filter), PostgreSQL store on ${report.clientVersion} + ${redis}; ${report.elapsedS} s in all`,
    formatDeaths(report.client, report.crashes),
    `operations: ${n(s.operations)} (${n(s.completed)} answered 2xx${report.throttled > 0 ? `, ${n(report.throttled)} not started: concurrency cap` : ''}); attempts: ${n(s.attempts)}; effects: ${n(s.effects)}`,
    `attempt outcomes: ${outcomes}`,
    `replays received: ${n(s.replaysReceived)}; key reuses refused with 422: ${n(s.reusesRefused)}; provider calls: ${n(report.providerCalls)} (${n(report.providerReplays)} answered from the provider's own key)`,
    `lease-mode handler re-runs absorbed by the provider key: ${n(s.leaseReruns)}; records left in progress after their 2xx, completed by the drain's retry: ${n(report.settledByDrain)}`,
    report.reconciler === null
      ? 'reconciler: none in this version of the plugin'
      : `reconciler (store.reconcile, a worker process, every 2 s): ${n(report.reconciler.passes)} passes took ${n(report.reconciler.examined)} stuck records in hand (a record no client retried is taken again at a later pass): ${n(report.reconciler.completed)} completed from their recorded charge, ${n(report.reconciler.resumed)} resumed for the next retry, ${n(report.reconciler.left)} left for a later pass (held records of the held scenario, younger than 2.5 s); ${n(report.reconciler.errors)} failed passes or records`,
    `faults injected (effective/injected): ${n(injected)} in all: ${faults}`,
    `lease-boundary scenarios (lease 300 ms, ttl 1 s where short): ${scenarios === '' ? 'none' : scenarios}; ${n(report.interventions)} force releases, partitions, table locks and listener kills`,
    `executions (from the instances' evidence logs): ${n(e.executions)}; takeovers ${n(e.takeovers)}; re-executions allowed: ${n(r['after-release'])} after a release, ${n(r['after-retention'])} after the retention, ${n(r['resumed-by-reconciler'])} resumed by the reconciler, ${n(r['after-dead-owner'])} after a dead owner, ${n(r['after-hold'])} after a hold (resolved or not: see execution-while-held), ${n(r['after-lapsed-owner'])} after an owner that finished without settling, ${n(r['force-released'])} after a force release, ${n(r['cut-from-db'])} while the owner was cut from the database, ${n(r['store-too-slow'])} while the owner's renewals took longer than its lease, ${n(r['owner-stalled'])} while the owner's process was frozen`,
    `lease boundaries crossed${minimum > 0 ? ` (at least ${n(minimum)} each required)` : ''}: ${crossed === '' ? 'none' : crossed}`,
    ...q === null
      ? []
      : [
          `queue door (${q.workers} job workers, idempotencyRunner, at-least-once delivery with a visibility timeout): ${n(q.jobs)} jobs, ${n(Object.values(q.deliveries).reduce((sum, count) => sum + count, 0))} deliveries: ${n(q.deliveries.first)} first, ${n(q.deliveries.visibility)} after a visibility timeout, ${n(q.deliveries.retry)} after a refusal or failure, ${n(q.deliveries.duplicate)} to two workers at once, ${n(q.deliveries.late)} after the acknowledgement`,
          `queue boundaries crossed${queueMinimum > 0 ? ` (at least ${n(queueMinimum)} each required)` : ''}: ${queueCrossed}`
        ],
    `also: ${n(e.clientDisconnects)} client disconnects seen by a running owner, ${n(e.handlersOutlivingLease)} handlers slower than their lease, ${n(e.holds)} keys held for the reconciler, ${n(e.forceReleases)} force releases, ${n(e.partitions)} partitions of one instance, ${n(e.stepsRefused)} steps refused with LeaseLostError (${n(e.stepsRefusedAfterFence)} after their fn ran on a proven key: the store answered the owner after its lease)`
  ]
  for (const event of report.faultEvents) {
    if (!event.effective) lines.push(`  no evidence for ${event.kind} at ${(event.at / 1000).toFixed(1)} s: ${event.detail}`)
  }
  if (report.faultsMissing.length > 0) lines.push(`FAULT COVERAGE NOT MET: ${report.faultsMissing.join(', ')}`)
  if (report.boundariesMissing.length > 0) {
    lines.push(`BOUNDARIES NOT CROSSED ENOUGH: ${report.boundariesMissing.map((boundary) => `${boundary} ${e.boundaries[boundary]} < ${report.minCrossings[boundary]}`).join(', ')}`)
  }
  const kinds = new Map<string, number>()
  for (const violation of report.violations) kinds.set(violation.kind, (kinds.get(violation.kind) ?? 0) + 1)
  lines.push(`violations: ${report.violations.length}${kinds.size === 0 ? '' : ` (${[...kinds].map(([kind, count]) => `${kind} ${n(count)}`).join(', ')})`}`)
  return lines.join('\n')
}
