/**
 * benchmarks/results/summary.json: the figures of the latest full run of every benchmark script, one
 * section each, from which docs/benchmarks.md, the README's Performance section and the chart
 * (chart.ts) are written. A script replaces its own section and keeps the others. Quick and partial
 * runs write summary.quick.json (ignored by git) unless given `--out`: they never replace published figures.
 */
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

/**
 * One setup of one `npm run bench` scenario: req/s (median over the rounds); its ratio to each other
 * setup (medians of slice pairs: figures.ts); the server's own latency of POST /pay in µs (medians),
 * and its p99 over bare's in the same round; what reached PostgreSQL and Redis per request, from
 * the sequential probe (exact) where the scenario has one, else over the load (the storm); and the
 * server process's CPU time per request under the load.
 */
export interface SetupFigures {
  requestsPerSecond: number
  ratioTo: Record<string, number>
  p50Us: number
  p99Us: number
  p99_9Us: number
  p99ToBare: number | null
  pgStatements: number | null
  pgRoundTrips: number | null
  redisCommands: number | null
  redisRoundTrips: number | null
  /** CPU time of the server process per request under the load, in µs. */
  serverCpuUs: number | null
}

/** `payload`: the response's size in bytes; `floors`: the floor each setup is held to. */
export interface ScenarioFigures { description: string, payload: number, connections: number, rounds: number, slices: number, floors: Record<string, string>, setups: Record<string, SetupFigures> }

export interface LoadSection {
  environment: { cpu: string, cores: number, node: string, fastify: string, postgres: string, postgresClient: string, peer: string, pinned: boolean, durability: string }
  scenarios: Record<string, ScenarioFigures>
}

export interface MemoryFill { records: number, rssMiB: number, heapUsedMiB: number, arrayBuffersMiB: number, rssBytesPerRecord: number, rssMBFor1M: number, extrapolated: boolean }

/** 1,000,000 completed records filled through the plugin. */
export interface MemorySection { node: string, bodyBytes: number, fill: MemoryFill }

export interface ClaimFormFigures { claimsPerSecond: number, toCte: number, pgCpuUsPerClaim: number | null }
export interface ClaimFormsSection {
  postgres: string,
  rounds: number,
  claims: number,
  concurrency: number
  paths: { fresh: Record<string, ClaimFormFigures>, duplicate: Record<string, ClaimFormFigures> }
  walBytesPerDuplicate: Record<string, number>
}

export interface FingerprintSection {
  node: string
  rounds: number
  bodies: Array<{ name: string, bytes: number, parseMs: number, canonicalMs: number, keyedMs: number, canonicalToParse: number, keyedToParse: number }>
}

export interface ReferenceSide { tableBytes: number, bodyBytesPerRecord: number, freshPerSecond: number, replayPerSecond: number }
/** `ratios`: by reference over full response. */
export interface ReferenceSection { records: number, responseBytes: number, full: ReferenceSide, ref: ReferenceSide, ratios: { tableBytes: number, fresh: number, replay: number } }

/** bench:storm (storm.ts): duplicates that wait for their original across instances, per mode. */
export interface StormFigures {
  mode: 'lease' | 'atomic'
  duplicates: number
  handlerMs: number
  handlerRuns: number
  statuses: Record<string, number>
  commitToAnswer: { p50: number, p99: number, max: number }
  statementsPerWaiter: number
  otherRoute: { p99Alone: number, p99DuringStorm: number, ratio: number, requestsDuringStorm: number }
}
export interface StormSection { instances: number, pool: number, results: StormFigures[] }

export interface Summary { load?: LoadSection, memory?: MemorySection, claimForms?: ClaimFormsSection, fingerprint?: FingerprintSection, reference?: ReferenceSection, storm?: StormSection }

const RESULTS = fileURLToPath(new URL('./results/', import.meta.url))
export const SUMMARY = path.join(RESULTS, 'summary.json')

/** Where a script writes: `--out`, else summary.json (summary.quick.json with --quick). */
export function summaryPath (out: string | undefined, quick: boolean): string {
  return out ?? path.join(RESULTS, quick ? 'summary.quick.json' : 'summary.json')
}

export function readSummary (file: string = SUMMARY): Summary {
  return existsSync(file) ? JSON.parse(readFileSync(file, 'utf8')) as Summary : {}
}

/** Replaces one section of `file`, keeping the others. */
export function writeSection<K extends keyof Summary> (file: string, key: K, section: NonNullable<Summary[K]>): void {
  const summary = readSummary(file)
  summary[key] = section
  mkdirSync(path.dirname(file), { recursive: true })
  writeFileSync(file, `${JSON.stringify(summary, null, 1)}\n`)
}
