/**
 * The ratios both harnesses report (run.ts with autocannon, crosscheck.ts with wrk), each a median
 * of slice-pair ratios of req/s between two setups of one scenario (slicedRatio). crosscheck.ts
 * compares its own to the latest run.ts result's, so the list is shared.
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
  { scenario: 'fresh', setup: 'pg-redis', to: 'pg-redis-unpipelined' },
  { scenario: 'replay', setup: 'memory', to: 'bare' },
  { scenario: 'replay', setup: 'peer-memory', to: 'bare' },
  { scenario: 'replay', setup: 'memory', to: 'peer-memory' },
  { scenario: 'replay', setup: 'pg-lease', to: 'floor-select' },
  { scenario: 'replay', setup: 'pg-redis', to: 'pg-lease' },
  { scenario: 'replay', setup: 'pg-redis', to: 'bare' },
  { scenario: 'replay', setup: 'pg-redis', to: 'pg-redis-unpipelined' },
  { scenario: 'storm', setup: 'pg-lease', to: 'bare' },
  { scenario: 'storm', setup: 'pg-redis', to: 'pg-lease' },
  { scenario: 'storm', setup: 'pg-redis', to: 'bare' },
  { scenario: 'storm', setup: 'pg-redis', to: 'pg-redis-unpipelined' },
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

/**
 * One setup's rate in each slice of each round: `[round][slice]`, slices in the order the setup
 * took them. Null where a slice was not measured (the measured side's CPU off Linux).
 */
export type SliceFigures = ReadonlyArray<ReadonlyArray<number | null>>

/**
 * The median, over every round and slice, of a's figure over b's in the same slice of the same
 * round (a round's k-th slices of two setups are seconds apart). Why not the ratio of whole
 * rounds: this machine's speed changes for seconds at a time (another guest's load on the host),
 * and a change that falls on some slices of a round and not others moves a round's ratio by 20%
 * and more, while the slice pairs it spoils are a few among twenty, which the median leaves out.
 * `invert`: b's figure over a's (CPU per request, where less is better). Null when no pair was measured.
 */
export function slicedRatio (a: SliceFigures, b: SliceFigures, invert = false): number | null {
  const pairs: number[] = []
  for (let round = 0; round < Math.min(a.length, b.length); round++) {
    const mine = a[round]!
    const theirs = b[round]!
    for (let slice = 0; slice < Math.min(mine.length, theirs.length); slice++) {
      const x = mine[slice]
      const y = theirs[slice]
      if (x === null || x === undefined || y === null || y === undefined) continue
      const value = invert ? y / x : x / y
      if (Number.isFinite(value) && value > 0) pairs.push(value)
    }
  }
  return pairs.length === 0 ? null : Math.round(median(pairs) * 1000) / 1000
}
