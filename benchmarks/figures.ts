/**
 * run.ts's measurements reduced to the figures the summary keeps (summary-file.ts SetupFigures),
 * and the table that prints them.
 */
import type { SetupFigures } from './summary-file.js'

export interface Latency { samples: number, p50: number, p99: number, p99_9: number }

export interface PerRequest { pgStatements: number | null, pgRoundTrips: number | null, redisCommands: number | null, redisRoundTrips: number | null, serverCpuUs: number | null }

/** One setup's measurement in one round of one scenario: `sliceRates`, req/s of each slice in turn; `problems`, wrong answers (any fails the run). */
export interface Run { scenario: string, setup: string, round: number, sliceRates: number[], requestsPerSecond: number, latencyUs: Latency, perRequest: PerRequest, problems: string[] }

export function median (values: readonly number[]): number {
  const sorted = values.filter(Number.isFinite).sort((a, b) => a - b)
  if (sorted.length === 0) return NaN
  const mid = sorted.length >> 1
  return sorted.length % 2 === 1 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2
}

const round3 = (value: number): number => Math.round(value * 1000) / 1000

/**
 * The median, over every round and slice, of a's rate over b's in the same slice of the same round
 * (`[round][slice]`). The k-th slices of two setups are seconds apart, so a slow spell of the
 * machine that spoils a few slice pairs is left out by the median instead of moving a whole
 * round's ratio. Null when no pair was measured.
 */
export function slicedRatio (a: ReadonlyArray<readonly number[]>, b: ReadonlyArray<readonly number[]>): number | null {
  const pairs: number[] = []
  for (let round = 0; round < Math.min(a.length, b.length); round++) {
    for (let slice = 0; slice < Math.min(a[round]!.length, b[round]!.length); slice++) {
      const value = a[round]![slice]! / b[round]![slice]!
      if (Number.isFinite(value) && value > 0) pairs.push(value)
    }
  }
  return pairs.length === 0 ? null : round3(median(pairs))
}

/** Each setup's figures in one scenario: medians over the rounds, ratios of slice pairs. */
export function summarise (runs: readonly Run[], setups: readonly string[]): Record<string, SetupFigures> {
  const of = (setup: string): Run[] => runs.filter((run) => run.setup === setup).sort((x, y) => x.round - y.round)
  const slices = (setup: string): number[][] => of(setup).map((run) => run.sliceRates)
  const bare = of('bare')
  return Object.fromEntries(setups.map((setup) => {
    const mine = of(setup)
    const counted = (pick: (p: PerRequest) => number | null): number | null => {
      const values = mine.map((run) => pick(run.perRequest)).filter((v): v is number => v !== null)
      return values.length === 0 ? null : round3(median(values))
    }
    const ratioTo = Object.fromEntries(setups.filter((other) => other !== setup).flatMap((other) => {
      const value = slicedRatio(slices(setup), slices(other))
      return value === null ? [] : [[other, value]]
    }))
    const p99ToBare = mine.flatMap((run) => {
      const base = bare.find((b) => b.round === run.round)?.latencyUs.p99
      return base === undefined ? [] : [run.latencyUs.p99 / base]
    })
    const figures: SetupFigures = {
      requestsPerSecond: Math.round(median(mine.map((run) => run.requestsPerSecond))),
      ratioTo,
      p50Us: median(mine.map((run) => run.latencyUs.p50)),
      p99Us: median(mine.map((run) => run.latencyUs.p99)),
      p99_9Us: median(mine.map((run) => run.latencyUs.p99_9)),
      p99ToBare: p99ToBare.length === 0 ? null : round3(median(p99ToBare)),
      pgStatements: counted((p) => p.pgStatements),
      pgRoundTrips: counted((p) => p.pgRoundTrips),
      redisCommands: counted((p) => p.redisCommands),
      redisRoundTrips: counted((p) => p.redisRoundTrips),
      serverCpuUs: counted((p) => p.serverCpuUs)
    }
    return [setup, figures]
  }))
}

const fixed = (value: number | null | undefined): string => value === null || value === undefined ? '—' : value.toFixed(2)

/** A scenario's figures as a Markdown table. */
export function table (title: string, setups: Record<string, SetupFigures>, floors: Record<string, string>): string {
  const head = ['setup', 'req/s', '× bare', '× floor', 'p50 µs', 'p99 µs', 'p99.9 µs', 'server CPU µs/req', 'PG stmts/req', 'PG RT/req', 'Redis cmds/req', 'Redis RT/req']
  const rows = Object.entries(setups).map(([setup, f]) => [
    setup,
    f.requestsPerSecond.toLocaleString('en-US'),
    setup === 'bare' ? '1.00' : fixed(f.ratioTo.bare),
    floors[setup] === undefined ? '' : `${fixed(f.ratioTo[floors[setup]])} ${floors[setup]}`,
    String(f.p50Us), String(f.p99Us), String(f.p99_9Us),
    f.serverCpuUs === null ? '—' : String(Math.round(f.serverCpuUs)),
    fixed(f.pgStatements), fixed(f.pgRoundTrips), fixed(f.redisCommands), fixed(f.redisRoundTrips)
  ])
  const widths = head.map((h, i) => Math.max(h.length, ...rows.map((cells) => cells[i]!.length)))
  const line = (cells: string[]): string => `| ${cells.map((c, i) => i === 0 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!)).join(' | ')} |`
  return [title, line(head), `|${widths.map((w, i) => i === 0 ? `:${'-'.repeat(w + 1)}` : `${'-'.repeat(w + 1)}:`).join('|')}|`, ...rows.map(line)].join('\n')
}
