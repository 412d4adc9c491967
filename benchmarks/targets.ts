/**
 * The plugin's performance targets, each judged on the summary's figures: met, missed (and by how
 * much) or not measured. `npm run bench` prints them all; nothing here fails a run.
 */
import type { SetupFigures, Summary } from './summary-file.js'

interface Target {
  text: string
  /** The figure, null when it was not measured. */
  value: (summary: Summary) => number | null
  at: 'least' | 'most' | 'exactly'
  goal: number
  unit: string
}

const figures = (summary: Summary, scenario: string, setup: string): SetupFigures | undefined => summary.load?.scenarios[scenario]?.setups[setup]
const ratio = (scenario: string, setup: string, to: string) => (s: Summary): number | null => figures(s, scenario, setup)?.ratioTo[to] ?? null
const field = (scenario: string, setup: string, name: 'p99ToBare' | 'pgStatements' | 'pgRoundTrips' | 'redisRoundTrips') => (s: Summary): number | null => figures(s, scenario, setup)?.[name] ?? null

export const TARGETS: readonly Target[] = [
  { text: 'memory store, fresh keys ≥ 0.85× bare', value: ratio('fresh', 'memory', 'bare'), at: 'least', goal: 0.85, unit: '× bare' },
  { text: 'memory store, replays ≥ 0.9× bare', value: ratio('replay', 'memory', 'bare'), at: 'least', goal: 0.9, unit: '× bare' },
  { text: 'memory store, fresh keys ≥ 1.3× the peer\'s memory adapter', value: ratio('fresh', 'memory', 'peer-memory'), at: 'least', goal: 1.3, unit: '× peer-memory' },
  { text: 'memory store, replays ≥ 1.3× the peer\'s memory adapter', value: ratio('replay', 'memory', 'peer-memory'), at: 'least', goal: 1.3, unit: '× peer-memory' },
  { text: 'memory store, fresh keys: server p99 ≤ 1.5× bare\'s', value: field('fresh', 'memory', 'p99ToBare'), at: 'most', goal: 1.5, unit: '× bare\'s p99' },
  { text: 'memory store, replays: server p99 ≤ 1.5× bare\'s', value: field('replay', 'memory', 'p99ToBare'), at: 'most', goal: 1.5, unit: '× bare\'s p99' },
  { text: 'memory store, 1,000,000 records filled through the plugin ≤ 500 MB RSS (npm run bench:memory)', value: (s) => s.memory?.fill.rssMBFor1M ?? null, at: 'most', goal: 500, unit: 'MB' },
  { text: 'Postgres lease, fresh keys ≥ 0.9× floor-sql', value: ratio('fresh', 'pg-lease', 'floor-sql'), at: 'least', goal: 0.9, unit: '× floor-sql' },
  { text: 'Postgres lease, fresh keys: exactly 2 statements', value: field('fresh', 'pg-lease', 'pgStatements'), at: 'exactly', goal: 2, unit: 'statements per request' },
  { text: 'Postgres lease, replays ≥ 0.9× floor-select', value: ratio('replay', 'pg-lease', 'floor-select'), at: 'least', goal: 0.9, unit: '× floor-select' },
  { text: 'Postgres lease, replays: 1 statement', value: field('replay', 'pg-lease', 'pgStatements'), at: 'exactly', goal: 1, unit: 'statements per request' },
  { text: 'atomic mode, fresh keys ≥ 0.9× floor-txn', value: ratio('fresh', 'pg-atomic', 'floor-txn'), at: 'least', goal: 0.9, unit: '× floor-txn' },
  { text: 'atomic mode, fresh keys: ≤ 5 round trips', value: field('fresh', 'pg-atomic', 'pgRoundTrips'), at: 'most', goal: 5, unit: 'round trips per request' },
  { text: 'Redis pre-filter, fresh keys ≥ 0.9× Postgres lease alone', value: ratio('fresh', 'pg-redis', 'pg-lease'), at: 'least', goal: 0.9, unit: '× pg-lease' },
  { text: 'Redis pre-filter, fresh keys: at most 1 Redis round trip', value: field('fresh', 'pg-redis', 'redisRoundTrips'), at: 'most', goal: 1, unit: 'Redis round trips per request' },
  { text: 'Redis pre-filter, replays ≥ 0.7× bare', value: ratio('replay', 'pg-redis', 'bare'), at: 'least', goal: 0.7, unit: '× bare' },
  { text: 'Redis pre-filter, replays: 0 store statements', value: field('replay', 'pg-redis', 'pgStatements'), at: 'exactly', goal: 0, unit: 'statements per request' },
  { text: 'Redis pre-filter, storm ≥ the peer\'s Redis adapter', value: ratio('storm', 'pg-redis', 'peer-redis'), at: 'least', goal: 1, unit: '× peer-redis' },
  { text: 'Redis pre-filter, storm: ≤ 0.01 store statements per request', value: field('storm', 'pg-redis', 'pgStatements'), at: 'most', goal: 0.01, unit: 'statements per request' }
]

export interface TargetResult { text: string, value: number | null, met: boolean | null, shortBy: number | null }

export function evaluateTargets (summary: Summary): TargetResult[] {
  return TARGETS.map((t) => {
    const value = t.value(summary)
    if (value === null || !Number.isFinite(value)) return { text: t.text, value: null, met: null, shortBy: null }
    const gap = t.at === 'least' ? t.goal - value : t.at === 'most' ? value - t.goal : Math.abs(value - t.goal)
    const met = t.at === 'exactly' ? gap < 0.005 : gap <= 0
    return { text: t.text, value, met, shortBy: met ? 0 : Math.round(gap * 1000) / 1000 }
  })
}

/** Every target, one line each, after a count of those met. */
export function targetsReport (summary: Summary): string {
  const results = evaluateTargets(summary)
  const lines = results.map((r, i) => {
    const unit = TARGETS[i]!.unit
    const measured = r.value === null ? 'not measured' : `${Number.isInteger(r.value) ? r.value : r.value.toFixed(2)}${unit.startsWith('×') ? '' : ' '}${unit}`
    const verdict = r.met === null ? '' : r.met ? ': met' : `: missed by ${r.shortBy}`
    return `- ${r.text}: ${measured}${verdict}`
  })
  const measured = results.filter((r) => r.met !== null).length
  return [`targets: ${results.filter((r) => r.met === true).length} of ${measured} measured met (${results.length} in all)`, ...lines].join('\n')
}
