import type { CheckResult, Violation } from './checker.js'
import type { ChaosConfig } from './config.js'
import { FAULT_KINDS, type FaultKind } from './faults.js'
import type { Crash, FaultEvent } from './history.js'
import type { ReconcilerStats } from './reconciler.js'

/** The run's outcome as the runner prints it and writes it to `--report` (JSON) for the test. */
export interface ChaosReport {
  readonly mode: ChaosConfig['mode']
  readonly seed: number
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
  /** Processes that died without being killed (each restarted by its supervisor). */
  readonly crashes: readonly Crash[]
  /** Kinds below the run's minimum of effective injections; the run fails if any. */
  readonly faultsMissing: readonly FaultKind[]
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

export function formatSummary (report: ChaosReport): string {
  const s = report.stats
  const outcomes = Object.entries(s.outcomes).sort((a, b) => b[1] - a[1]).map(([name, count]) => `${name} ${n(count)}`).join(', ')
  const redis = report.redis === 'both' ? 'standalone Redis, then (rolling restart) a 3-master Redis Cluster' : report.redis === 'cluster' ? '3-master Redis Cluster' : 'standalone Redis'
  const faults = FAULT_KINDS.map((kind) => `${kind} ${report.faults[kind].effective}/${report.faults[kind].injected}`).join(', ')
  const injected = FAULT_KINDS.reduce((sum, kind) => sum + report.faults[kind].injected, 0)
  const lines = [
    `chaos ${report.mode} run, seed ${report.seed}: ${report.durationS} s of faults, ${report.instances} instances, PostgreSQL store + ${redis}; ${report.elapsedS} s in all`,
    `operations: ${n(s.operations)} (${n(s.completed)} answered 2xx${report.throttled > 0 ? `, ${n(report.throttled)} not started: concurrency cap` : ''}); attempts: ${n(s.attempts)}; effects: ${n(s.effects)}`,
    `attempt outcomes: ${outcomes}`,
    `replays received: ${n(s.replaysReceived)}; key reuses refused with 422: ${n(s.reusesRefused)}; provider calls: ${n(report.providerCalls)} (${n(report.providerReplays)} answered from the provider's own key)`,
    `lease-mode handler re-runs absorbed by the provider key: ${n(s.leaseReruns)}; records left in progress after their 2xx, completed by the drain's retry: ${n(report.settledByDrain)}`,
    report.reconciler === null
      ? 'reconciler: none in this version of the plugin'
      : `reconciler (store.reconcile, a worker process, every 2 s): ${n(report.reconciler.passes)} passes took ${n(report.reconciler.examined)} stuck records in hand (a record no client retried is taken again at a later pass): ${n(report.reconciler.completed)} completed from their recorded charge, ${n(report.reconciler.resumed)} resumed for the next retry; ${n(report.reconciler.errors)} failed passes or records`,
    `faults injected (effective/injected): ${n(injected)} in all: ${faults}`
  ]
  if (report.crashes.length > 0) {
    const causes = new Map<string, number>()
    for (const crash of report.crashes) causes.set(crash.knownCause ?? 'UNKNOWN CAUSE', (causes.get(crash.knownCause ?? 'UNKNOWN CAUSE') ?? 0) + 1)
    lines.push(`processes that died on their own (restarted by their supervisor): ${report.crashes.length}: ${[...causes].map(([cause, count]) => `${count} × ${cause}`).join('; ')}`)
  }
  for (const event of report.faultEvents) {
    if (!event.effective) lines.push(`  no evidence for ${event.kind} at ${(event.at / 1000).toFixed(1)} s: ${event.detail}`)
  }
  if (report.faultsMissing.length > 0) lines.push(`FAULT COVERAGE NOT MET: ${report.faultsMissing.join(', ')}`)
  lines.push(`violations: ${report.violations.length}`)
  return lines.join('\n')
}
