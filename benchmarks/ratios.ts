/**
 * The ratios both harnesses report (run.ts with autocannon, crosscheck.ts with wrk), each a median
 * of per-round ratios of req/s between two setups of one scenario, measured in the same round.
 * crosscheck.ts compares its own to the latest run.ts result's, so the list is shared.
 */
export interface RatioPair {
  scenario: 'fresh' | 'replay' | 'storm'
  setup: string
  to: string
}

export const RATIOS: readonly RatioPair[] = [
  { scenario: 'fresh', setup: 'memory', to: 'bare' },
  { scenario: 'fresh', setup: 'peer-memory', to: 'bare' },
  { scenario: 'fresh', setup: 'memory', to: 'peer-memory' },
  { scenario: 'fresh', setup: 'pg-lease', to: 'floor-sql' },
  { scenario: 'fresh', setup: 'pg-atomic', to: 'floor-txn' },
  { scenario: 'fresh', setup: 'pg-redis', to: 'pg-lease' },
  { scenario: 'replay', setup: 'memory', to: 'bare' },
  { scenario: 'replay', setup: 'peer-memory', to: 'bare' },
  { scenario: 'replay', setup: 'memory', to: 'peer-memory' },
  { scenario: 'replay', setup: 'pg-lease', to: 'floor-select' },
  { scenario: 'replay', setup: 'pg-redis', to: 'pg-lease' },
  { scenario: 'replay', setup: 'pg-redis', to: 'bare' },
  { scenario: 'storm', setup: 'pg-lease', to: 'bare' },
  { scenario: 'storm', setup: 'pg-redis', to: 'pg-lease' },
  { scenario: 'storm', setup: 'pg-redis', to: 'bare' },
  { scenario: 'storm', setup: 'peer-redis', to: 'bare' }
]

export const ratioName = (pair: RatioPair): string => `${pair.scenario}: ${pair.setup} ÷ ${pair.to}`

/** The setups a scenario needs for the ratios of `pairs`, in first-seen order. */
export function setupsOf (scenario: string, pairs: readonly RatioPair[] = RATIOS): string[] {
  const names: string[] = []
  for (const pair of pairs) {
    if (pair.scenario !== scenario) continue
    for (const name of [pair.to, pair.setup]) if (!names.includes(name)) names.push(name)
  }
  return names
}

export function median (values: readonly number[]): number {
  const sorted = values.filter(Number.isFinite).sort((a, b) => a - b)
  if (sorted.length === 0) return NaN
  const mid = sorted.length >> 1
  return sorted.length % 2 === 1 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2
}

/** A ratio and, when there were several rounds, each round's: `0.712 (rounds: 0.737 0.712 0.539)`. */
export function ratioWithRounds (value: number | null, byRound: readonly number[]): string {
  return `${value === null ? '—' : value.toFixed(3)}${byRound.length > 1 ? ` (rounds: ${byRound.map((v) => v.toFixed(3)).join(' ')})` : ''}`
}
