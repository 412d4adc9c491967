/**
 * run.ts's measurements, their in-round ratios, their medians over the rounds, and the table that
 * prints them.
 */
import { perCpuRatio } from './measured-cpu.js'
import { median, slicedRatio, type SliceFigures } from './ratios.js'

export const SETUPS = ['bare', 'memory', 'peer-memory', 'pg-lease', 'pg-atomic', 'pg-redis', 'pg-redis-unpipelined', 'peer-redis', 'floor-sql', 'floor-select', 'floor-txn'] as const
export type Setup = typeof SETUPS[number]

/** Per request: PostgreSQL statements or Redis commands, and round trips (benchmarks/counting.ts). */
export interface PerRequest { statements: number, roundTrips: number }

export interface Counts {
  /** POST /pay responses the server sent in the window (the denominator). */
  requests: number
  pg: PerRequest | null
  redis: PerRequest | null
}

/** µs of CPU per request of the server's process, of PostgreSQL's processes and of Redis's. */
export interface CpuSplitPerRequest { server: number, postgres: number, redis: number }

export interface Latency { samples: number, p50: number, p99: number, p99_9: number }

export interface Run {
  scenario: string
  round: number
  setup: Setup
  requestsPerSecond: number
  requests: number
  durationSeconds: number
  /** How many slices the measured load was cut into (run.ts measureRound). */
  slices: number
  /** req/s of each slice, in the order this setup took them (ratios.ts slicedRatio). */
  sliceRates: number[]
  /** The measured side's CPU per request in each slice, µs; null off Linux. */
  sliceCpuUsPerRequest: Array<number | null>
  /** CPU time autocannon's process used over the load's duration (1 = one whole CPU): near 1, the generator bounds the rate. */
  generatorCpuShare: number
  /** The measured side's CPU per request (server + PostgreSQL + Redis, benchmarks/measured-cpu.ts), µs; null off Linux. */
  measuredCpuUsPerRequest: number | null
  /** The same, by process: the server's, PostgreSQL's and Redis's (what a setup's cost is made of). */
  measuredCpuSplitUsPerRequest: CpuSplitPerRequest | null
  /** Another setup's CPU per request over this one's, same round: req/s per CPU of the measured side, as a ratio. */
  cpuRatioTo: Record<string, number>
  connections: number
  /** The server's own latency of POST /pay (onRequest to onResponse), µs: what overhead adds. */
  latencyUs: Latency
  /** latencyUs over bare's in the same round and scenario. */
  latencyRatioToBare: { p50: number, p99: number, p99_9: number } | null
  /** autocannon's histogram, client-side (includes the load generator's queueing): whole milliseconds. */
  latencyMs: { p50: number, p90: number, p99: number, p99_9: number, mean: number, max: number }
  statusCodes: Record<string, number>
  non2xx: number
  errors: number
  timeouts: number
  /** Operations the server executed during the measured load (GET /stats before and after). */
  executions: number
  /** The same, counting from before the warm-up. */
  executionsWithWarmup: number
  /**
   * What reached PostgreSQL / Redis during the measured load, per request. Statements and commands
   * are exact; round trips under concurrent load are a lower bound (counting.ts).
   */
  load: Counts
  /** The same over requests sent one at a time after the load: exact round trips (null: not probed). */
  probe: Counts | null
  peakRssMiB: number
  /** req/s over each other setup's in the same round and scenario. */
  ratioTo: Record<string, number>
  ratioToBare: number | null
  /** The floor this setup is held to in this scenario (Scenario.floors), and the ratio to it. */
  floor: Setup | null
  ratioToFloor: number | null
  /** A wrong answer: the run fails. */
  problems: string[]
  /** A target's statement or round-trip count not met: reported, the run does not fail. */
  warnings: string[]
}

export interface Summary {
  setup: Setup
  requestsPerSecond: number
  requestsPerSecondByRound: number[]
  /** Slice-pair medians over every round (ratios.ts slicedRatio). */
  ratioTo: Record<string, number>
  ratioToBare: number | null
  floor: Setup | null
  ratioToFloor: number | null
  /** The measured side's CPU per request, µs (median over the rounds), and its slice-pair ratios (another setup's CPU per request over this one's). */
  measuredCpuUsPerRequest: number | null
  /** Medians over the rounds of Run.measuredCpuSplitUsPerRequest. */
  cpuSplitUsPerRequest: CpuSplitPerRequest | null
  cpuRatioTo: Record<string, number>
  /** Server-side latency, µs (medians over the rounds), and its ratio to bare's (medians of in-round ratios). */
  p50Us: number
  p99Us: number
  p99_9Us: number
  p50UsToBare: number | null
  p99UsToBare: number | null
  p99_9UsToBare: number | null
  /** Client-side latency (autocannon), whole ms. */
  clientP50Ms: number
  clientP99Ms: number
  non2xx: number
  errors: number
  peakRssMiB: number
  /** Medians over the rounds, per request (null: not counted). */
  pgStatements: number | null
  pgRoundTrips: number | null
  redisCommands: number | null
  redisRoundTrips: number | null
  /** The same, from the sequential probe: exact. */
  probePgStatements: number | null
  probePgRoundTrips: number | null
  probeRedisCommands: number | null
  probeRedisRoundTrips: number | null
  warnings: string[]
}

export const ratio = (a: number, b: number): number => Math.round(a / b * 1000) / 1000

/** Ratios within a round: the two runs were measured minutes apart at most, on the same drift. */
export function addRatios (runs: Run[]): void {
  for (const run of runs) {
    const others = runs.filter((r) => r.scenario === run.scenario && r.round === run.round && r !== run)
    for (const other of others) {
      run.ratioTo[other.setup] = ratio(run.requestsPerSecond, other.requestsPerSecond)
      const perCpu = perCpuRatio(run.measuredCpuUsPerRequest, other.measuredCpuUsPerRequest)
      if (perCpu !== null) run.cpuRatioTo[other.setup] = perCpu
    }
    const bare = others.find((r) => r.setup === 'bare')
    if (run.setup === 'bare') {
      run.ratioToBare = 1
      run.latencyRatioToBare = { p50: 1, p99: 1, p99_9: 1 }
    } else if (bare !== undefined) {
      run.ratioToBare = run.ratioTo.bare ?? null
      run.latencyRatioToBare = {
        p50: ratio(run.latencyUs.p50, bare.latencyUs.p50),
        p99: ratio(run.latencyUs.p99, bare.latencyUs.p99),
        p99_9: ratio(run.latencyUs.p99_9, bare.latencyUs.p99_9)
      }
    }
    if (run.floor !== null) run.ratioToFloor = run.ratioTo[run.floor] ?? null
  }
}

/** A setup's figures of one scenario by slice, `[round][slice]`, rounds in order (ratios.ts slicedRatio). */
export function sliceFigures (runs: readonly Run[], scenario: string, setup: string, pick: (run: Run) => ReadonlyArray<number | null>): SliceFigures {
  const mine = runs.filter((run) => run.scenario === scenario && run.setup === setup)
  const rounds = Math.max(0, ...mine.map((run) => run.round))
  return Array.from({ length: rounds }, (_, i) => {
    const run = mine.find((r) => r.round === i + 1)
    return run === undefined ? [] : pick(run)
  })
}

/**
 * Medians over the rounds of each setup's figures; its ratios to the other setups are slice-pair
 * medians over every round (ratios.ts slicedRatio), of req/s and per CPU of the measured side.
 */
export function summarise (runs: Run[], scenario: string, setups: readonly Setup[]): Summary[] {
  const rates = (setup: string): SliceFigures => sliceFigures(runs, scenario, setup, (run) => run.sliceRates)
  const cpu = (setup: string): SliceFigures => sliceFigures(runs, scenario, setup, (run) => run.sliceCpuUsPerRequest)
  return setups.map((setup) => {
    const mine = runs.filter((run) => run.scenario === scenario && run.setup === setup)
    const medianOf = (pick: (run: Run) => number | null | undefined): number | null => {
      const values = mine.map(pick).filter((v): v is number => typeof v === 'number')
      return values.length === 0 ? null : Math.round(median(values) * 1000) / 1000
    }
    const others = [...new Set(mine.flatMap((run) => Object.keys(run.ratioTo)))]
    const ratioTo = Object.fromEntries(others.flatMap((other) => {
      const value = slicedRatio(rates(setup), rates(other))
      return value === null ? [] : [[other, value]]
    }))
    const floor = mine[0]?.floor ?? null
    return {
      setup,
      requestsPerSecond: median(mine.map((run) => run.requestsPerSecond)),
      requestsPerSecondByRound: mine.map((run) => run.requestsPerSecond),
      ratioTo,
      ratioToBare: setup === 'bare' ? 1 : ratioTo.bare ?? null,
      floor,
      ratioToFloor: floor === null ? null : ratioTo[floor] ?? null,
      measuredCpuUsPerRequest: medianOf((run) => run.measuredCpuUsPerRequest),
      cpuSplitUsPerRequest: mine.length === 0 || mine.some((run) => run.measuredCpuSplitUsPerRequest === null)
        ? null
        : {
            server: medianOf((run) => run.measuredCpuSplitUsPerRequest?.server)!,
            postgres: medianOf((run) => run.measuredCpuSplitUsPerRequest?.postgres)!,
            redis: medianOf((run) => run.measuredCpuSplitUsPerRequest?.redis)!
          },
      cpuRatioTo: Object.fromEntries(others.flatMap((other) => {
        const value = slicedRatio(cpu(setup), cpu(other), true)
        return value === null ? [] : [[other, value]]
      })),
      p50Us: median(mine.map((run) => run.latencyUs.p50)),
      p99Us: median(mine.map((run) => run.latencyUs.p99)),
      p99_9Us: median(mine.map((run) => run.latencyUs.p99_9)),
      p50UsToBare: medianOf((run) => run.latencyRatioToBare?.p50),
      p99UsToBare: medianOf((run) => run.latencyRatioToBare?.p99),
      p99_9UsToBare: medianOf((run) => run.latencyRatioToBare?.p99_9),
      clientP50Ms: median(mine.map((run) => run.latencyMs.p50)),
      clientP99Ms: median(mine.map((run) => run.latencyMs.p99)),
      non2xx: mine.reduce((sum, run) => sum + run.non2xx, 0),
      errors: mine.reduce((sum, run) => sum + run.errors, 0),
      peakRssMiB: Math.max(...mine.map((run) => run.peakRssMiB)),
      pgStatements: medianOf((run) => run.load.pg?.statements),
      pgRoundTrips: medianOf((run) => run.load.pg?.roundTrips),
      redisCommands: medianOf((run) => run.load.redis?.statements),
      redisRoundTrips: medianOf((run) => run.load.redis?.roundTrips),
      probePgStatements: medianOf((run) => run.probe?.pg?.statements),
      probePgRoundTrips: medianOf((run) => run.probe?.pg?.roundTrips),
      probeRedisCommands: medianOf((run) => run.probe?.redis?.statements),
      probeRedisRoundTrips: medianOf((run) => run.probe?.redis?.roundTrips),
      warnings: [...new Set(mine.flatMap((run) => run.warnings))]
    }
  })
}

const fixed = (v: number | null, digits = 2): string => v === null ? '—' : v.toFixed(digits)

/** "load/probe": the count under load, and the exact one of the sequential probe. */
function pair (load: number | null, probe: number | null): string {
  if (load === null && probe === null) return '—'
  return `${fixed(load)}/${fixed(probe)}`
}

export function table (title: string, rows: Summary[]): string {
  const head = ['setup', 'req/s', '× bare', '× floor', 'p50 µs (× bare)', 'p99 µs (× bare)', 'p99.9 µs (× bare)', 'client p50/p99 ms', 'CPU µs/req (app+PG+Redis)', 'non-2xx', 'errors',
    'PG stmts/req', 'PG RT/req', 'Redis cmds/req', 'Redis RT/req', 'peak RSS', 'req/s by round']
  const us = (value: number, toBare: number | null): string => `${Number.isFinite(value) ? Math.round(value) : '—'} (${fixed(toBare)})`
  const body = rows.map((row) => [
    row.setup,
    Math.round(row.requestsPerSecond).toLocaleString('en-US'),
    fixed(row.ratioToBare),
    row.floor === null ? '—' : `${fixed(row.ratioToFloor)} ${row.floor}`,
    us(row.p50Us, row.p50UsToBare),
    us(row.p99Us, row.p99UsToBare),
    us(row.p99_9Us, row.p99_9UsToBare),
    `${row.clientP50Ms}/${row.clientP99Ms}`,
    row.measuredCpuUsPerRequest === null
      ? '—'
      : `${Math.round(row.measuredCpuUsPerRequest)}${row.cpuSplitUsPerRequest === null ? '' : ` (${['server', 'postgres', 'redis'].map((part) => Math.round(row.cpuSplitUsPerRequest![part as keyof CpuSplitPerRequest])).join('+')})`}`,
    String(row.non2xx),
    String(row.errors),
    pair(row.pgStatements, row.probePgStatements),
    pair(row.pgRoundTrips, row.probePgRoundTrips),
    pair(row.redisCommands, row.probeRedisCommands),
    pair(row.redisRoundTrips, row.probeRedisRoundTrips),
    `${row.peakRssMiB} MiB`,
    row.requestsPerSecondByRound.map((v) => v.toLocaleString('en-US')).join(' ')
  ])
  const widths = head.map((h, i) => Math.max(h.length, ...body.map((cells) => cells[i]!.length)))
  const line = (cells: string[]): string => `| ${cells.map((c, i) => i === 0 || i === cells.length - 1 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!)).join(' | ')} |`
  const warnings = rows.flatMap((row) => row.warnings.map((w) => `  warning: ${row.setup}: ${w}`))
  return [
    title,
    line(head),
    `|${widths.map((w, i) => i === 0 || i === widths.length - 1 ? `:${'-'.repeat(w + 1)}` : `${'-'.repeat(w + 1)}:`).join('|')}|`,
    ...body.map(line),
    ...warnings
  ].join('\n')
}
