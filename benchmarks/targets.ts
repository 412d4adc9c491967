/**
 * Issue 14's targets, each judged on one run of run.ts: met, missed (and by how much), or not
 * measured (a filtered or failed run). The lead publishes this section; nothing here fails a run.
 */
import type { Summary } from './summary.js'

export interface TargetResult {
  id: string
  target: string
  /** What was measured, in words ("0.45× bare"). */
  measured: string
  value: number | null
  /** met: the target holds; null: not measured in this run. */
  met: boolean | null
  /** How far from the target, in its unit (0 when met). */
  shortBy: number | null
}

type Rows = Record<string, Summary[]>

interface Target {
  id: string
  target: string
  scenario: string
  setup: string
  /** The figure; null when it was not measured. */
  value: (row: Summary, rows: Summary[]) => number | null
  /** ≥ goal (at least), ≤ goal (at most) or = goal (exactly, to 0.005). */
  goal: { at: 'least' | 'most' | 'exactly', value: number }
  unit: (value: number) => string
}

const times = (to: string) => (v: number): string => `${v.toFixed(2)}× ${to}`
const per = (what: string) => (v: number): string => `${v.toFixed(v === 0 || v >= 0.1 ? 2 : 4)} ${what} per request`
const ratioTo = (to: string) => (row: Summary): number | null => row.ratioTo[to] ?? null

const TARGETS: readonly Target[] = [
  { id: 'memory-fresh', target: 'memory store, fresh keys ≥ 0.85× bare', scenario: 'fresh', setup: 'memory', value: ratioTo('bare'), goal: { at: 'least', value: 0.85 }, unit: times('bare') },
  { id: 'memory-replay', target: 'memory store, replays ≥ 0.9× bare', scenario: 'replay', setup: 'memory', value: ratioTo('bare'), goal: { at: 'least', value: 0.9 }, unit: times('bare') },
  { id: 'memory-fresh-peer', target: 'memory store, fresh keys ≥ 1.3× the peer\'s memory adapter', scenario: 'fresh', setup: 'memory', value: ratioTo('peer-memory'), goal: { at: 'least', value: 1.3 }, unit: times('peer-memory') },
  { id: 'memory-replay-peer', target: 'memory store, replays ≥ 1.3× the peer\'s memory adapter', scenario: 'replay', setup: 'memory', value: ratioTo('peer-memory'), goal: { at: 'least', value: 1.3 }, unit: times('peer-memory') },
  { id: 'memory-fresh-p99', target: 'memory store, fresh keys: server p99 ≤ 1.5× bare\'s', scenario: 'fresh', setup: 'memory', value: (row) => row.p99UsToBare, goal: { at: 'most', value: 1.5 }, unit: times('bare\'s p99') },
  { id: 'memory-replay-p99', target: 'memory store, replays: server p99 ≤ 1.5× bare\'s', scenario: 'replay', setup: 'memory', value: (row) => row.p99UsToBare, goal: { at: 'most', value: 1.5 }, unit: times('bare\'s p99') },
  { id: 'lease-fresh', target: 'Postgres lease, fresh keys ≥ 0.9× floor-sql', scenario: 'fresh', setup: 'pg-lease', value: ratioTo('floor-sql'), goal: { at: 'least', value: 0.9 }, unit: times('floor-sql') },
  { id: 'lease-fresh-statements', target: 'Postgres lease, fresh keys: exactly 2 statements', scenario: 'fresh', setup: 'pg-lease', value: (row) => row.probePgStatements, goal: { at: 'exactly', value: 2 }, unit: per('statements') },
  { id: 'lease-replay', target: 'Postgres lease, replays ≥ 0.9× floor-select', scenario: 'replay', setup: 'pg-lease', value: ratioTo('floor-select'), goal: { at: 'least', value: 0.9 }, unit: times('floor-select') },
  { id: 'lease-replay-statements', target: 'Postgres lease, replays: 1 statement', scenario: 'replay', setup: 'pg-lease', value: (row) => row.probePgStatements, goal: { at: 'exactly', value: 1 }, unit: per('statements') },
  { id: 'atomic-fresh', target: 'atomic mode, fresh keys ≥ 0.9× floor-txn', scenario: 'fresh', setup: 'pg-atomic', value: ratioTo('floor-txn'), goal: { at: 'least', value: 0.9 }, unit: times('floor-txn') },
  { id: 'atomic-fresh-round-trips', target: 'atomic mode, fresh keys: ≤ 5 round trips', scenario: 'fresh', setup: 'pg-atomic', value: (row) => row.probePgRoundTrips, goal: { at: 'most', value: 5 }, unit: per('round trips') },
  { id: 'prefilter-fresh', target: 'Redis pre-filter, fresh keys ≤ 10% slower than Postgres lease alone (≥ 0.9×)', scenario: 'fresh', setup: 'pg-redis', value: ratioTo('pg-lease'), goal: { at: 'least', value: 0.9 }, unit: times('pg-lease') },
  { id: 'prefilter-fresh-redis', target: 'Redis pre-filter, fresh keys: at most 1 Redis round trip', scenario: 'fresh', setup: 'pg-redis', value: (row) => row.probeRedisRoundTrips, goal: { at: 'most', value: 1 }, unit: per('Redis round trips') },
  { id: 'prefilter-replay', target: 'Redis pre-filter, replays ≥ 0.7× bare', scenario: 'replay', setup: 'pg-redis', value: ratioTo('bare'), goal: { at: 'least', value: 0.7 }, unit: times('bare') },
  { id: 'prefilter-replay-statements', target: 'Redis pre-filter, replays: 0 store statements', scenario: 'replay', setup: 'pg-redis', value: (row) => row.pgStatements, goal: { at: 'exactly', value: 0 }, unit: per('statements') },
  {
    id: 'prefilter-storm',
    target: 'Redis pre-filter, storm ≥ the peer\'s Redis storm ratio (to bare)',
    scenario: 'storm',
    setup: 'pg-redis',
    value: ratioTo('peer-redis'),
    goal: { at: 'least', value: 1 },
    unit: times('peer-redis')
  },
  { id: 'prefilter-storm-statements', target: 'Redis pre-filter, storm: ≤ 0.01 store statements per request', scenario: 'storm', setup: 'pg-redis', value: (row) => row.pgStatements, goal: { at: 'most', value: 0.01 }, unit: per('statements') }
]

const EXACT = 0.005

export function evaluateTargets (rows: Rows): TargetResult[] {
  return TARGETS.map((t) => {
    const scenarioRows = rows[t.scenario] ?? []
    const row = scenarioRows.find((r) => r.setup === t.setup)
    const value = row === undefined ? null : t.value(row, scenarioRows)
    if (value === null || !Number.isFinite(value)) return { id: t.id, target: t.target, measured: 'not measured', value: null, met: null, shortBy: null }
    const gap = t.goal.at === 'least' ? t.goal.value - value : t.goal.at === 'most' ? value - t.goal.value : Math.abs(value - t.goal.value)
    const met = t.goal.at === 'exactly' ? gap < EXACT : gap <= 0
    let measured = t.unit(value)
    if (t.id === 'prefilter-storm' && row !== undefined) {
      const peer = scenarioRows.find((r) => r.setup === 'peer-redis')
      measured += ` (${row.ratioToBare?.toFixed(2) ?? '—'}× bare against the peer's ${peer?.ratioToBare?.toFixed(2) ?? '—'}×)`
    }
    return { id: t.id, target: t.target, measured, value, met, shortBy: met ? 0 : Math.round(gap * 1000) / 1000 }
  })
}

export function targetsTable (results: TargetResult[]): string {
  const verdict = (r: TargetResult): string => r.met === null ? 'not measured' : r.met ? 'met' : `missed (by ${r.shortBy})`
  const rows = results.map((r) => [r.target, r.measured, verdict(r)])
  const head = ['target (issue 14)', 'measured', '']
  const widths = head.map((h, i) => Math.max(h.length, ...rows.map((cells) => cells[i]!.length)))
  const line = (cells: string[]): string => `| ${cells.map((c, i) => c.padEnd(widths[i]!)).join(' | ')} |`
  const met = results.filter((r) => r.met === true).length
  const measured = results.filter((r) => r.met !== null).length
  return [
    `targets: ${met} of ${measured} measured met (${results.length} in all)`,
    line(head),
    `|${widths.map((w) => '-'.repeat(w + 2)).join('|')}|`,
    ...rows.map(line)
  ].join('\n')
}
