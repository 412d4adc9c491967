/**
 * The benchmark (issues 3, 5, 14): `node --import tsx benchmarks/run.ts [--quick] [--out file]
 * [--only scenario,…] [--setups setup,…] [--rounds n] [--pin | --unpinned]`. Pinning: see benchmarks/pinning.ts.
 *
 * Starts a throwaway PostgreSQL and Redis (scripts/services.mjs) unless DATABASE_URL and REDIS_URL
 * are set, creates a fresh schema (benchmarks/schema.ts), and measures each scenario with its setups
 * interleaved (A B C … A B C …) so that the machine's drift hits every setup alike. Each measurement
 * gets its own server process (benchmarks/server.ts) on a loopback port, loaded from this process
 * with autocannon's programmatic API; then, for the setups with a database, a short sequential probe
 * (one request at a time) counts the exact statements and round trips of one request. Reports
 * medians over the rounds and ratios taken within a round (to bare, to the setup's floor, to every
 * other setup: `ratioTo` in the JSON): req/s, the server's own latency in microseconds (p50/p99/
 * p99.9, hrtime from onRequest to onResponse; GET /stats), autocannon's client-side latency in whole
 * milliseconds, and what reached PostgreSQL and Redis per request (benchmarks/counting.ts). Prints a
 * table per scenario, the ratios crosscheck.ts reproduces (benchmarks/ratios.ts) and issue 14's
 * targets, met or missed (benchmarks/targets.ts); writes benchmarks/results/postgres.json and
 * docs/benchmarks-chart.svg (the chart ships with the docs that show it, so the README's image
 * resolves on npm as on GitHub; postgres.quick.json and chart.quick.svg beside it with --quick or
 * next to --out, so a development run never overwrites the published figures).
 *
 * --quick: 1 round of short loads (sized by the warm-up's rate, at least 3 requests per connection:
 * quickAmount), and each server serves every scenario of its setup and body size in turn (tables
 * emptied in between) instead of one process per measurement: seconds, for the
 * test suite; its figures are not comparable. --only / --setups: a subset (a check of one scenario).
 *
 * Extending it: a setup is a name in summary.ts's SETUPS plus an entry in server.ts's SETUPS; a
 * scenario is an entry in SCENARIOS (its setups, its floors, its request stream, what it checks).
 */
import type { ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import type autocannon from 'autocannon'
import postgres from 'postgres'
import { chart } from './chart.js'
import { autocannonLoad as load, keyed } from './autocannon-load.js'
import { median, RATIOS, ratioName, ratioWithRounds } from './ratios.js'
import { BODY } from './route.js'
import { startBenchServer } from './server-process.js'
import { benchServices } from './services.js'
import { cpuMsSince, pinning } from './pinning.js'
import { cpuUsPerRequest, measuredCpuSplitMs, type CpuSplit } from './measured-cpu.js'
import { createBenchSchema, describeDatabase, truncateBenchSchema } from './schema.js'
import { addRatios, SETUPS, summarise, table, type Counts, type Latency, type PerRequest, type Run, type Setup, type Summary } from './summary.js'
import { evaluateTargets, targetsTable } from './targets.js'

const ROOT = fileURLToPath(new URL('..', import.meta.url))

const { values: args } = parseArgs({
  options: {
    quick: { type: 'boolean', default: false },
    out: { type: 'string' },
    only: { type: 'string' },
    setups: { type: 'string' },
    rounds: { type: 'string' },
    pin: { type: 'boolean', default: false },
    unpinned: { type: 'boolean', default: false }
  }
})
const QUICK = args.quick === true
const OUT = args.out ?? path.join(ROOT, 'benchmarks', 'results', QUICK ? 'postgres.quick.json' : 'postgres.json')
const CHART = QUICK || args.out !== undefined
  ? path.join(path.dirname(OUT), QUICK ? 'chart.quick.svg' : 'chart.svg')
  : path.join(ROOT, 'docs', 'benchmarks-chart.svg')
function roundsArg (value: string | undefined): number {
  const rounds = Number(value ?? 5)
  if (!Number.isInteger(rounds) || rounds < 1) throw new Error(`--rounds must be a whole number >= 1, received ${value}`)
  return rounds
}
/** Read before anything runs: a busy machine skews every figure. */
const loadAverageAtStart = os.loadavg()

/**
 * How each measurement loads its server: the main scenarios, and the scale scenarios (fewer rounds
 * and shorter, to bound the run). The warm-up is long because a new server reaches its steady rate
 * only after seconds of load (V8's tiers, the heap's growth: bare served 9,639 requests in its first
 * second and about 25,000 a second from its fifth); the measured load is cut in slices of 1 s that
 * the setups take in turns (measureRound).
 */
interface Timing { rounds: number, durationSeconds: number, slices: number, warmupSeconds: number }
const ROUNDS = QUICK ? 1 : roundsArg(args.rounds)
const CONFIG = {
  rounds: ROUNDS,
  connections: 10,
  main: { rounds: ROUNDS, durationSeconds: QUICK ? 0.3 : 4, slices: QUICK ? 1 : 4, warmupSeconds: QUICK ? 0.1 : 3 } satisfies Timing,
  scale: { rounds: Math.min(ROUNDS, 3), durationSeconds: QUICK ? 0.2 : 2, slices: QUICK ? 1 : 2, warmupSeconds: QUICK ? 0.05 : 2 } satisfies Timing,
  poolMax: 10,
  replayKeys: QUICK ? 20 : 100,
  /** The sequential probe: requests sent first (connections' first statements prepare), then counted. */
  probe: { warmup: QUICK ? 3 : 10, requests: QUICK ? 10 : 40 }
} as const

/** Quick mode's least measured load (quickAmount). */
const QUICK_MIN_REQUESTS_PER_CONNECTION = 3
/** The setups with a database or Redis, whose traffic is counted and probed. */
const COUNTED: ReadonlySet<Setup> = new Set(['pg-lease', 'pg-atomic', 'pg-redis', 'pg-redis-unpipelined', 'peer-redis', 'floor-sql', 'floor-select', 'floor-txn'])
/** The duplicate storm: many connections on few keys, each key hammered concurrently (issue 5). */
const STORM = { connections: 200, keys: 20 } as const
const KiB = 1024
const MiB = 1024 * 1024
/** The scale scenarios (issue 14: the cost curve over connections and body sizes) run only these. */
const SCALE_SETUPS: readonly Setup[] = ['bare', 'memory', 'peer-memory', 'pg-lease']

interface Scenario {
  name: string
  description: string
  /** The response body's size in bytes (BENCH_PAYLOAD). */
  payload: number
  connections: number
  timing: Timing
  setups: readonly Setup[]
  /** The floor each setup is held to here. */
  floors: Partial<Record<Setup, Setup>>
  /** Runs once against each new server, before its warm-up. */
  prepare?: (url: string, tag: string) => Promise<void>
  /** autocannon's request list; `tag` is unique to the measurement. */
  requests: (tag: string) => autocannon.Request[]
  /** The probe's i-th key (none: not probed). */
  probeKey?: (i: number, tag: string) => string
  /** Statuses that are a correct answer here besides 2xx (a storm's 409s). */
  allowedNon2xx?: readonly number[]
  /** What must hold of a measured run (beyond 0 errors): its problems (the run fails) and warnings. */
  check: (run: Run) => { problems?: string[], warnings?: string[] }
}

/** Shared by the warm-up and the measured load, so a key is never sent twice. */
let freshCounter = 0
const replayKey = (i: number, tag: string): string => `"r-${i}-${tag}"`

const near = (value: number | undefined, goal: number): boolean => value !== undefined && Math.abs(value - goal) < 0.005

/** The statement counts of issue 14's targets (warnings) and of the floors (problems: the counting itself is wrong). */
function countChecks (run: Run, expected: Partial<Record<Setup, { statements?: number, maxRoundTrips?: number, maxRedisRoundTrips?: number }>>, floors: Partial<Record<Setup, number>>): { problems: string[], warnings: string[] } {
  const problems: string[] = []
  const warnings: string[] = []
  const probe = run.probe
  const floor = floors[run.setup]
  if (floor !== undefined && probe?.pg !== null && probe !== null && !near(probe.pg?.statements, floor)) {
    problems.push(`${probe.pg?.statements} statements per request, where the floor runs ${floor}: the counting is wrong`)
  }
  const want = expected[run.setup]
  if (want === undefined || probe === null) return { problems, warnings }
  if (want.statements !== undefined && !near(probe.pg?.statements, want.statements)) warnings.push(`${probe.pg?.statements} statements per request (target: ${want.statements})`)
  if (want.maxRoundTrips !== undefined && (probe.pg?.roundTrips ?? Infinity) > want.maxRoundTrips + 0.005) warnings.push(`${probe.pg?.roundTrips} round trips per request (target: at most ${want.maxRoundTrips})`)
  if (want.maxRedisRoundTrips !== undefined && (probe.redis?.roundTrips ?? Infinity) > want.maxRedisRoundTrips + 0.005) warnings.push(`${probe.redis?.roundTrips} Redis round trips per request (target: at most ${want.maxRedisRoundTrips})`)
  return { problems, warnings }
}

/**
 * Executions too many: problems for our setups and the floors; for the peer's, warnings: it is what
 * its Fastify adapter does (peer-glue.ts: a replay whose client disconnects runs the handler, and
 * every load ends by closing its connections).
 */
function executionCheck (run: Run, found: string[]): { problems: string[], warnings: string[] } {
  if (!run.setup.startsWith('peer-')) return { problems: found, warnings: [] }
  return { problems: [], warnings: found.map((text) => `${text} (the peer's adapter runs the handler for a replay whose client disconnected: see peer-glue.ts)`) }
}

function describePayload (bytes: number): string {
  return bytes >= MiB ? `${Math.round(bytes / MiB)} MiB responses` : bytes >= KiB ? `${Math.round(bytes / KiB)} KiB responses` : `${bytes}-byte responses`
}

interface Shape { name: string, payload: number, connections: number, timing: Timing, setups: readonly Setup[], floors?: Partial<Record<Setup, Setup>> }

function fresh ({ name, payload, connections, timing, setups, floors = {} }: Shape): Scenario {
  return {
    name,
    description: `every request a new key; ${describePayload(payload)}, ${connections} connection(s)`,
    payload,
    connections,
    timing,
    setups,
    floors,
    requests: (tag) => keyed(() => `"k-${freshCounter++}-${tag}"`),
    probeKey: (i, tag) => `"p-${i}-${tag}"`,
    check (run) {
      // A request in flight when a load stops still executes, uncounted: up to one per connection
      // after each slice of the measured load (counted here, but for the last one's).
      const problems = Math.abs(run.executions - run.requests) <= (run.slices + 1) * connections ? [] : [`${run.executions} executions for ${run.requests} fresh keys`]
      const counts = countChecks(run, {
        'pg-lease': { statements: 2 },
        'pg-atomic': { maxRoundTrips: 5 },
        'pg-redis': { statements: 2, maxRedisRoundTrips: 1 }
      }, { 'floor-sql': 2, 'floor-txn': 5 })
      return { problems: [...problems, ...counts.problems], warnings: counts.warnings }
    }
  }
}

function replay ({ name, payload, connections, timing, setups, floors = {} }: Shape): Scenario {
  return {
    name,
    description: `requests cycle over ${CONFIG.replayKeys} keys completed beforehand; ${describePayload(payload)}, ${connections} connection(s)`,
    payload,
    connections,
    timing,
    setups,
    floors,
    async prepare (url, tag) {
      for (let i = 0; i < CONFIG.replayKeys; i += CONFIG.connections) {
        await Promise.all(Array.from({ length: Math.min(CONFIG.connections, CONFIG.replayKeys - i) }, async (_, j) => {
          const status = await post(url, replayKey(i + j, tag))
          if (status !== 201) throw new Error(`replay warm-up: key ${i + j} answered ${status}`)
        }))
      }
    },
    requests (tag) {
      let i = 0
      return keyed(() => replayKey(i++ % CONFIG.replayKeys, tag))
    },
    probeKey: (i, tag) => replayKey(i % CONFIG.replayKeys, tag),
    check (run) {
      // bare has no idempotency: it executes every request.
      const executed = run.setup === 'bare' || run.executions === 0 ? [] : [`${run.executions} executions during replays`]
      const counts = countChecks(run, { 'pg-lease': { statements: 1 }, 'pg-redis': { statements: 0 } }, { 'floor-select': 1 })
      const executions = executionCheck(run, executed)
      return { problems: [...executions.problems, ...counts.problems], warnings: [...executions.warnings, ...counts.warnings] }
    }
  }
}

const MAIN = { connections: CONFIG.connections, timing: CONFIG.main, payload: 200 }
const SCALE = { connections: CONFIG.connections, timing: CONFIG.scale, payload: 200, setups: SCALE_SETUPS }
const ALL_SCENARIOS: readonly Scenario[] = [
  fresh({ ...MAIN, name: 'fresh', setups: ['bare', 'memory', 'peer-memory', 'pg-lease', 'pg-atomic', 'pg-redis', 'pg-redis-unpipelined', 'peer-redis', 'floor-sql', 'floor-txn'], floors: { 'pg-lease': 'floor-sql', 'pg-redis': 'floor-sql', 'pg-atomic': 'floor-txn' } }),
  replay({ ...MAIN, name: 'replay', setups: ['bare', 'memory', 'peer-memory', 'pg-lease', 'pg-atomic', 'pg-redis', 'pg-redis-unpipelined', 'peer-redis', 'floor-select'], floors: { 'pg-lease': 'floor-select', 'pg-redis': 'floor-select', 'pg-atomic': 'floor-select' } }),
  {
    name: 'storm',
    description: `${STORM.connections} connections hammering ${STORM.keys} keys (duplicates: 409 while in flight, then replays); ${describePayload(200)}`,
    payload: 200,
    connections: STORM.connections,
    timing: CONFIG.main,
    setups: ['bare', 'pg-lease', 'pg-redis', 'pg-redis-unpipelined', 'peer-redis'],
    floors: {},
    allowedNon2xx: [409],
    requests (tag) {
      let i = 0
      return keyed(() => `"s-${i++ % STORM.keys}-${tag}"`)
    },
    check (run) {
      const executed = run.setup === 'bare' || run.executionsWithWarmup === STORM.keys ? [] : [`${run.executionsWithWarmup} executions for ${STORM.keys} keys`]
      const statements = run.load.pg?.statements
      const warnings = run.setup === 'pg-redis' && statements !== undefined && statements > 0.01 ? [`${statements} statements per request (target: at most 0.01)`] : []
      const executions = executionCheck(run, executed)
      return { problems: executions.problems, warnings: [...executions.warnings, ...warnings] }
    }
  },
  fresh({ ...SCALE, name: 'fresh-c1', connections: 1 }),
  replay({ ...SCALE, name: 'replay-c1', connections: 1 }),
  fresh({ ...SCALE, name: 'fresh-c100', connections: 100 }),
  replay({ ...SCALE, name: 'replay-c100', connections: 100 }),
  fresh({ ...SCALE, name: 'fresh-64k', payload: 64 * KiB }),
  replay({ ...SCALE, name: 'replay-64k', payload: 64 * KiB }),
  fresh({ ...SCALE, name: 'fresh-1m', payload: MiB }),
  replay({ ...SCALE, name: 'replay-1m', payload: MiB })
]

const listArg = (value: string | undefined): Set<string> | null => value === undefined ? null : new Set(value.split(',').map((s) => s.trim()).filter(Boolean))
const onlyScenarios = listArg(args.only)
const onlySetups = listArg(args.setups)
for (const name of onlyScenarios ?? []) if (!ALL_SCENARIOS.some((s) => s.name === name)) throw new Error(`--only: no scenario ${name}; one of ${ALL_SCENARIOS.map((s) => s.name).join(', ')}`)
for (const name of onlySetups ?? []) if (!(SETUPS as readonly string[]).includes(name)) throw new Error(`--setups: no setup ${name}; one of ${SETUPS.join(', ')}`)
const SCENARIOS = ALL_SCENARIOS
  .filter((s) => onlyScenarios === null || onlyScenarios.has(s.name))
  .map((s) => ({ ...s, setups: s.setups.filter((setup) => onlySetups === null || onlySetups.has(setup)) }))
  .filter((s) => s.setups.length > 0)

// --- the services ------------------------------------------------------------------------------

/** The server processes running (a round runs one per setup at once). */
const servers = new Set<ChildProcess>()
const services = await benchServices(() => { for (const child of servers) child.kill('SIGKILL') })
/** Pinning (benchmarks/pinning.ts): autocannon, in this process, on its own CPU; a full run's default. */
const PIN = pinning(args.pin === true ? 'pin' : args.unpinned === true || QUICK ? 'off' : 'auto')
PIN.moveServices()
const DATABASE_URL = services.databaseUrl
const REDIS_URL = services.redisUrl
const SCHEMA = `bench_${randomBytes(4).toString('hex')}`
const admin = postgres(DATABASE_URL, { max: 2, onnotice: () => {} })

// --- one measurement ----------------------------------------------------------------------------

interface Instance { setup: Setup, url: string, pid: number, stop: () => Promise<void> }

async function startServer (setup: Setup, payload: number): Promise<Instance> {
  const server = await startBenchServer({
    pin: PIN,
    env: { SETUP: setup, DATABASE_URL, REDIS_URL, BENCH_SCHEMA: SCHEMA, BENCH_POOL_MAX: String(CONFIG.poolMax), BENCH_PAYLOAD: String(payload) },
    label: setup,
    running: servers
  })
  return { setup, url: server.url, pid: server.pid, stop: server.stop }
}

/** One POST /pay with `key`; its status. */
async function post (url: string, key: string): Promise<number> {
  const response = await fetch(`${url}/pay`, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: BODY })
  await response.arrayBuffer()
  return response.status
}

interface Stats { executions: number, requests: number, pg: PerRequest | null, redis: PerRequest | null, latencyUs: Latency }

async function stats (url: string): Promise<Stats> {
  const response = await fetch(`${url}/stats`)
  const body = await response.json() as Omit<Stats, 'latencyUs'> & { latencyUs: { samples: number, p50: number | null, p99: number | null, p99_9: number | null } }
  const { samples, p50, p99, p99_9 } = body.latencyUs
  return { ...body, latencyUs: { samples, p50: p50 ?? NaN, p99: p99 ?? NaN, p99_9: p99_9 ?? NaN } }
}

/**
 * /stats once the server has gone quiet: the requests a load left in flight when it stopped still
 * run (and reach the backends) after autocannon has returned. Two polls 25 ms apart that agree, or 2 s.
 */
async function settled (url: string): Promise<Stats> {
  const shape = (s: Stats): string => JSON.stringify([s.executions, s.requests, s.pg, s.redis])
  let last = await stats(url)
  for (const deadline = Date.now() + 2000; Date.now() < deadline;) {
    await new Promise((resolve) => setTimeout(resolve, 25))
    const next = await stats(url)
    if (shape(next) === shape(last)) return next
    last = next
  }
  return last
}

/** What reached the backends between two /stats, per POST /pay answered in between. */
function countsBetween (before: Stats, after: Stats): Counts {
  const requests = after.requests - before.requests
  const per = (a: PerRequest | null, b: PerRequest | null): PerRequest | null => a === null || b === null || requests === 0
    ? null
    : { statements: Math.round((b.statements - a.statements) / requests * 1000) / 1000, roundTrips: Math.round((b.roundTrips - a.roundTrips) / requests * 1000) / 1000 }
  return { requests, pg: per(before.pg, after.pg), redis: per(before.redis, after.redis) }
}

/** Empties the server's latency histogram (so that it holds the measured load only). */
async function resetLatency (url: string): Promise<void> {
  const response = await fetch(`${url}/stats/reset`, { method: 'POST' })
  await response.arrayBuffer()
}

/** The server's peak resident set, from the kernel: VmHWM in /proc/<pid>/status. */
function peakRssMiB (pid: number): number {
  const match = /^VmHWM:\s+(\d+) kB/m.exec(readFileSync(`/proc/${pid}/status`, 'utf8'))
  return match === null ? NaN : Math.round(Number(match[1]) / 1024)
}

/** Requests one at a time: the exact statements and round trips of one request (counting.ts); statuses other than 2xx. */
async function probe (instance: Instance, scenario: Scenario, tag: string): Promise<{ counts: Counts | null, unexpected: number[] }> {
  const key = scenario.probeKey
  const unexpected: number[] = []
  if (key === undefined || !COUNTED.has(instance.setup)) return { counts: null, unexpected }
  await settled(instance.url) // what the load left in flight is no part of the probe
  const send = async (i: number): Promise<void> => {
    const status = await post(instance.url, key(i, tag))
    if (status < 200 || status >= 300) unexpected.push(status)
  }
  for (let i = 0; i < CONFIG.probe.warmup; i++) await send(i)
  const before = await stats(instance.url)
  for (let i = CONFIG.probe.warmup; i < CONFIG.probe.warmup + CONFIG.probe.requests; i++) await send(i)
  return { counts: countsBetween(before, await stats(instance.url)), unexpected }
}

/**
 * Quick mode's measured load, as a number of requests: what the warm-up's rate fits in the
 * duration, and never fewer than QUICK_MIN_REQUESTS_PER_CONNECTION per connection. A quick load of
 * 0.2 s by time alone can end with no request answered when the machine is busy (1 MiB bodies into
 * PostgreSQL while the rest of the suite runs: CI saw 0 req/s and nothing to count), and an empty
 * measurement proves nothing runs. Full runs keep their fixed durations.
 */
function quickAmount (warmup: autocannon.Result, scenario: Scenario): number | undefined {
  if (!QUICK) return undefined
  const fitted = Math.round(warmup.requests.total / Math.max(warmup.duration, 0.001) * scenario.timing.durationSeconds)
  return Math.max(fitted, QUICK_MIN_REQUESTS_PER_CONNECTION * scenario.connections)
}

/** One setup's measurement in progress: warmed up, then loaded slice by slice (interleaved with the other setups'). */
interface Measuring {
  readonly scenario: Scenario
  readonly instance: Instance
  readonly tag: string
  readonly requests: autocannon.Request[]
  readonly warmup: autocannon.Result
  readonly initial: Stats
  readonly before: Stats
  readonly slices: autocannon.Result[]
  /** The measured side's CPU in each slice, ms (null off Linux), and its parts summed over the slices. */
  readonly sliceCpuMs: Array<number | null>
  readonly cpuSplitMs: CpuSplit
  generatorCpuMs: number
}

/** Prepares the scenario on the server (replay keys), then warms it up; its measured window opens after. */
async function warmUp (scenario: Scenario, instance: Instance): Promise<Measuring> {
  const { url } = instance
  const tag = randomBytes(4).toString('hex')
  await scenario.prepare?.(url, tag)
  const requests = scenario.requests(tag)
  const initial = await stats(url)
  const warmup = await load(url, requests, scenario.timing.warmupSeconds, scenario.connections)
  // The measured window opens on a quiet server: nothing the warm-up started is counted in it.
  const before = await settled(url)
  await resetLatency(url)
  return { scenario, instance, tag, requests, warmup, initial, before, slices: [], sliceCpuMs: [], cpuSplitMs: { server: 0, postgres: 0, redis: 0 }, generatorCpuMs: 0 }
}

/** One slice of the measured load: `seconds` (quick mode: quickAmount's requests). */
async function loadSlice (m: Measuring, seconds: number): Promise<void> {
  const generatorStart = process.cpuUsage()
  const measuredStart = measuredCpuSplitMs(m.instance.pid)
  m.slices.push(await load(m.instance.url, m.requests, seconds, m.scenario.connections, quickAmount(m.warmup, m.scenario)))
  const measuredEnd = measuredCpuSplitMs(m.instance.pid)
  m.generatorCpuMs += cpuMsSince(generatorStart)
  if (measuredStart === null || measuredEnd === null) {
    m.sliceCpuMs.push(null)
    return
  }
  let total = 0
  for (const part of ['server', 'postgres', 'redis'] as const) {
    const used = measuredEnd[part] - measuredStart[part]
    m.cpuSplitMs[part] += used
    total += used
  }
  m.sliceCpuMs.push(total)
}

const sum = (values: readonly number[]): number => values.reduce((a, b) => a + b, 0)

/** The slices' figures as one Run, then the sequential probe and the scenario's checks. */
async function finish (m: Measuring, round: number): Promise<Run> {
  const { scenario, instance } = m
  const after = await stats(instance.url)
  const requests = sum(m.slices.map((r) => r.requests.total))
  const duration = sum(m.slices.map((r) => r.duration))
  // autocannon's client-side percentiles cannot be merged across slices: the median slice's is
  // reported (the server's own latency, latencyUs, is one histogram over every slice).
  const sliceMedian = (of: (r: autocannon.Result) => number): number => median(m.slices.map(of))
  const statusCodes: Record<string, number> = {}
  for (const slice of m.slices) {
    for (const [code, stat] of Object.entries(slice.statusCodeStats ?? {})) statusCodes[code] = (statusCodes[code] ?? 0) + (stat.count ?? 0)
  }
  const run: Run = {
    scenario: scenario.name,
    round,
    setup: instance.setup,
    requestsPerSecond: Math.round(requests / duration),
    requests,
    durationSeconds: Math.round(duration * 100) / 100,
    slices: m.slices.length,
    sliceRates: m.slices.map((r) => Math.round(r.requests.total / r.duration)),
    sliceCpuUsPerRequest: m.slices.map((r, i) => cpuUsPerRequest(0, m.sliceCpuMs[i] ?? null, r.requests.total)),
    // Near 1 (a whole CPU), autocannon itself is what bounds the request rate.
    generatorCpuShare: Math.round(m.generatorCpuMs / (duration * 1000) * 100) / 100,
    measuredCpuUsPerRequest: m.sliceCpuMs.includes(null) ? null : cpuUsPerRequest(0, sum(m.sliceCpuMs as number[]), requests),
    measuredCpuSplitUsPerRequest: m.sliceCpuMs.includes(null)
      ? null
      : { server: cpuUsPerRequest(0, m.cpuSplitMs.server, requests)!, postgres: cpuUsPerRequest(0, m.cpuSplitMs.postgres, requests)!, redis: cpuUsPerRequest(0, m.cpuSplitMs.redis, requests)! },
    cpuRatioTo: {},
    connections: scenario.connections,
    latencyUs: after.latencyUs,
    latencyRatioToBare: null,
    latencyMs: {
      p50: sliceMedian((r) => r.latency.p50),
      p90: sliceMedian((r) => r.latency.p90),
      p99: sliceMedian((r) => r.latency.p99),
      p99_9: sliceMedian((r) => r.latency.p99_9),
      mean: Math.round(sum(m.slices.map((r) => r.latency.mean * r.requests.total)) / Math.max(requests, 1) * 100) / 100,
      max: Math.max(...m.slices.map((r) => r.latency.max))
    },
    statusCodes,
    non2xx: sum(m.slices.map((r) => r.non2xx)),
    errors: sum(m.slices.map((r) => r.errors)),
    timeouts: sum(m.slices.map((r) => r.timeouts)),
    executions: after.executions - m.before.executions,
    executionsWithWarmup: after.executions - m.initial.executions,
    load: countsBetween(m.before, after),
    probe: null,
    peakRssMiB: peakRssMiB(instance.pid),
    ratioTo: {},
    ratioToBare: null,
    floor: scenario.floors[instance.setup] ?? null,
    ratioToFloor: null,
    problems: [],
    warnings: []
  }
  // After the load's figures are taken: the probe's requests are no part of them.
  const probed = await probe(instance, scenario, m.tag)
  run.probe = probed.counts
  if (probed.unexpected.length > 0) run.problems.push(`the sequential probe's requests answered ${probed.unexpected.join(', ')}`)
  const allowed = new Set(scenario.allowedNon2xx ?? [])
  const unexpected = Object.entries(run.statusCodes).some(([code, count]) => count > 0 && !code.startsWith('2') && !allowed.has(Number(code)))
  if (run.latencyUs.samples < run.requests) run.problems.push(`${run.latencyUs.samples} latency samples for ${run.requests} requests`)
  if (run.errors > 0 || unexpected) run.problems.push(`${run.errors} errors, ${run.non2xx} non-2xx (${JSON.stringify(run.statusCodes)})`)
  const checked = scenario.check(run)
  run.problems.push(...checked.problems ?? [])
  run.warnings.push(...checked.warnings ?? [])
  return run
}

/**
 * One round of a scenario, full mode: a new server per setup, all started together; each warmed
 * up in turn, then the measured load in slices, the setups taking turns slice by slice (the first
 * to go rotating each time), so that whatever the machine does meanwhile (another guest's load on
 * the host, which halved every rate here for tens of seconds at a time) falls on every setup alike.
 */
async function measureRound (scenario: Scenario, round: number, record: (run: Run) => void): Promise<void> {
  // Every round starts from empty tables, whatever ran before it.
  await truncateBenchSchema(admin, SCHEMA)
  const instances: Instance[] = []
  let failure: { error: unknown } | null = null
  try {
    for (const setup of scenario.setups) instances.push(await startServer(setup, scenario.payload))
    const measuring: Measuring[] = []
    for (const instance of instances) measuring.push(await warmUp(scenario, instance))
    const { slices, durationSeconds } = scenario.timing
    for (let slice = 0; slice < slices; slice++) {
      for (let turn = 0; turn < measuring.length; turn++) await loadSlice(measuring[(slice + turn) % measuring.length]!, durationSeconds / slices)
    }
    for (const m of measuring) record(await finish(m, round))
  } catch (error) {
    failure = { error }
  }
  // Every server is stopped, even when one fails to; the round's own failure is reported first.
  const stopped = await Promise.allSettled(instances.map((instance) => instance.stop()))
  if (failure !== null) throw failure.error
  const refused = stopped.find((result): result is PromiseRejectedResult => result.status === 'rejected')
  if (refused !== undefined) throw refused.reason
}

/**
 * Every measurement, in order. Full: for each scenario, its rounds (measureRound). Quick: one
 * server per setup and body size, serving its scenarios one after the other, one slice each.
 */
async function measureAll (onRun: (run: Run) => void): Promise<Run[]> {
  const runs: Run[] = []
  const record = (run: Run): void => { runs.push(run); onRun(run) }
  if (!QUICK) {
    for (const scenario of SCENARIOS) {
      for (let round = 1; round <= scenario.timing.rounds; round++) await measureRound(scenario, round, record)
    }
    return runs
  }
  const groups = new Map<string, { setup: Setup, payload: number, scenarios: Scenario[] }>()
  for (const scenario of SCENARIOS) {
    for (const setup of scenario.setups) {
      const id = `${setup}/${scenario.payload}`
      const group = groups.get(id) ?? { setup, payload: scenario.payload, scenarios: [] }
      group.scenarios.push(scenario)
      groups.set(id, group)
    }
  }
  for (const { setup, payload, scenarios } of groups.values()) {
    const instance = await startServer(setup, payload)
    try {
      for (const scenario of scenarios) {
        await truncateBenchSchema(admin, SCHEMA)
        const m = await warmUp(scenario, instance)
        await loadSlice(m, scenario.timing.durationSeconds)
        record(await finish(m, 1))
      }
    } finally {
      await instance.stop()
    }
  }
  return runs
}

function packageVersion (name: string): string {
  return (JSON.parse(readFileSync(path.join(ROOT, 'node_modules', name, 'package.json'), 'utf8')) as { version: string }).version
}

// --- main ---------------------------------------------------------------------------------------

const startedAt = new Date()
const log = (message: string): void => { process.stderr.write(`[bench] ${message}\n`) }
try {
  await createBenchSchema(admin, SCHEMA)
  const database = await describeDatabase(admin)
  const timing = (t: Timing): string => `${t.rounds} round(s) of ${t.warmupSeconds} s warm-up + ${t.durationSeconds} s${t.slices > 1 ? ` in ${t.slices} interleaved slices` : ''}`
  log(`PostgreSQL ${database.server_version} (fsync=${database.fsync}, synchronous_commit=${database.synchronous_commit}); ` +
    `main scenarios ${timing(CONFIG.main)}, scale scenarios ${timing(CONFIG.scale)} per measurement; ${PIN.description}` +
    `${QUICK ? '; quick: one server per setup and body size' : ''}`)

  const runs = await measureAll((run) => {
    const flags = [
      run.problems.length > 0 ? `PROBLEM: ${run.problems.join('; ')}` : '',
      run.warnings.length > 0 ? `warning: ${run.warnings.join('; ')}` : ''
    ].filter(Boolean).join('  ')
    log(`${run.scenario} round ${run.round} ${run.setup}: ${run.requestsPerSecond.toLocaleString('en-US')} req/s${flags === '' ? '' : `  ${flags}`}`)
  })
  addRatios(runs)

  const summaries = SCENARIOS.map((scenario) => ({ scenario, rows: summarise(runs, scenario.name, scenario.setups) }))
  const byName: Record<string, Summary[]> = Object.fromEntries(summaries.map(({ scenario, rows }) => [scenario.name, rows]))
  const ratios = RATIOS.map((pair) => {
    const row = byName[pair.scenario]?.find((summary) => summary.setup === pair.setup)
    const mine = runs.filter((run) => run.scenario === pair.scenario && run.setup === pair.setup)
    const byRound = mine.map((run) => run.ratioTo[pair.to]).filter((v): v is number => v !== undefined)
    const cpuByRound = mine.map((run) => run.cpuRatioTo[pair.to]).filter((v): v is number => v !== undefined)
    return { ...pair, name: ratioName(pair), ratio: row?.ratioTo[pair.to] ?? null, byRound, cpuRatio: row?.cpuRatioTo[pair.to] ?? null, cpuByRound }
  })
  const targets = evaluateTargets(byName)
  const notes = [
    `Ratios are medians over every round and slice of the two setups' figures in the same slice of the same round (benchmarks/ratios.ts slicedRatio); each round's own ratio is listed too ("rounds:"); other figures are medians over the rounds. Main scenarios (fresh, replay, storm): ${timing(CONFIG.main)} per measurement; the scale scenarios (-c1, -c100: connections; -64k, -1m: body size) run ${SCALE_SETUPS.join(', ')} only, ${timing(CONFIG.scale)} per measurement. In a round, every setup of the scenario has a new server process; each is warmed up in turn, then the setups take turns slice by slice, so that a change in the machine's speed during the round falls on each alike.`,
    'Every setup\'s POST /pay validates its body with the same JSON schema (amount an integer, currency three capital letters, no other property) and answers the same payment (benchmarks/route.ts); the -64k and -1m bodies are padded with incompressible base64 text.',
    'Latency in µs is the server\'s own (process.hrtime.bigint() from an onRequest hook added before any plugin to an onResponse hook, log-linear histogram under 1% error, reset after the warm-up), with its ratio to bare\'s in the same round; "client ms" is autocannon\'s, whole milliseconds, and includes queueing in the load generator.',
    'PG stmts/req, PG RT/req, Redis cmds/req, Redis RT/req: "load/seq", counted on the client\'s wire (benchmarks/counting.ts): statements are Execute and simple-Query messages (BEGIN and COMMIT included), Redis commands are ioredis sendCommand calls (peer-redis: its storage calls, one node-redis command each); a round trip is a write after a read on one connection. "load" is over the measured load (it starts on a quiet server; the requests in flight when it stops reach the backends uncounted as requests, so it is high by up to one request\'s statements per connection, noticeable only where few requests fit in a run) (round trips there are a lower bound: concurrent requests\' statements can share a write); "seq" is the probe after it, ' +
      `${CONFIG.probe.requests} requests one at a time (exact). The targets' counts use "seq", except the storm's and the replays' 0 statements, which use "load".`,
    `The peer is @node-idempotency/core ${packageVersion('@node-idempotency/core')} with its memory and Redis (node-redis ${packageVersion('redis')}) storage adapters, wired into Fastify by benchmarks/peer-glue.ts, which does what its unpublished Fastify adapter does (it also records replays and its own 409s, as the adapter does); the remaining differences are listed in that file's header.`,
    'Same-backend pairs: memory vs peer-memory (both in-process maps), and pg-redis vs peer-redis, the closest pair but not the same backend: peer-redis keeps everything in Redis (SET NX, then SET), where pg-redis keeps the records in PostgreSQL behind a Redis pre-filter. The peer\'s PostgreSQL adapter is not on the registry, so pg-lease and pg-atomic have no same-backend peer.',
    'Floors (no plugin, same pool, same migrate() table, prepared statements): floor-sql = INSERT … ON CONFLICT DO NOTHING claim + UPDATE recording the response (2 statements, autocommit); floor-select = one primary-key SELECT returning the stored body answers a replay; floor-txn = BEGIN, the claim, the same business INSERT as pg-atomic\'s, the UPDATE, COMMIT (5 statements, 5 round trips). pg-atomic and floor-txn are the only setups writing a business row.',
    `Durability: fsync=${database.fsync}, synchronous_commit=${database.synchronous_commit}, full_page_writes=${database.full_page_writes}` +
      (services.provisioned ? ' (the throwaway server of scripts/services.mjs: commits are not durable, so absolute figures are above a production server\'s; the floors run under the same settings).' : ' (the server of DATABASE_URL).'),
    'Load generator, servers, PostgreSQL and Redis share the machine\'s cores: expect about ±15% between runs.',
    '"CPU µs/req" is the measured side\'s CPU per request over the measured load: the server process plus every PostgreSQL and Redis process, user + system time from /proc (benchmarks/measured-cpu.ts), the generator not included. Each ratio is printed twice: of req/s, and "per CPU of the measured side" (the other setup\'s CPU per request over this one\'s, in the same round), the generator-independent form that benchmarks/crosscheck.ts reproduces where req/s depends on the generator\'s share of the cores.',
    ...(QUICK ? ['Quick mode: 1 round of short loads, one server per setup and body size serving its scenarios in turn; the figures only show that everything runs.'] : [])
  ]
  const ratioLines = ratios.map((r) => `- ${r.name}: ${ratioWithRounds(r.ratio, r.byRound)}; per CPU of the measured side: ${ratioWithRounds(r.cpuRatio, r.cpuByRound)}`)
  const output = [
    ...summaries.map(({ scenario, rows }) => table(`${scenario.name}: ${scenario.description}`, rows)),
    notes.map((note) => `- ${note}`).join('\n'),
    ['ratios (medians of slice-pair ratios, then each round\'s own; benchmarks/crosscheck.ts reproduces these with wrk):', ...ratioLines].join('\n'),
    targetsTable(targets)
  ].join('\n\n')
  process.stdout.write(`${output}\n`)

  const cpus = os.cpus()
  const result = {
    benchmark: 'postgres',
    date: startedAt.toISOString(),
    quick: QUICK,
    filtered: onlyScenarios !== null || onlySetups !== null,
    elapsedSeconds: Math.round((Date.now() - startedAt.getTime()) / 1000),
    machine: {
      cpuModel: cpus[0]?.model ?? 'unknown',
      cores: cpus.length,
      memoryGiB: Math.round(os.totalmem() / 2 ** 30 * 10) / 10,
      platform: `${os.platform()} ${os.release()}`,
      loadAverageAtStart,
      pinning: PIN.description
    },
    versions: {
      node: process.version,
      postgresServer: database.server_version,
      postgresClient: packageVersion('postgres'),
      fastify: packageVersion('fastify'),
      autocannon: packageVersion('autocannon'),
      peerCore: packageVersion('@node-idempotency/core'),
      peerStorageMemory: packageVersion('@node-idempotency/storage-adapter-memory'),
      peerStorageRedis: packageVersion('@node-idempotency/storage-adapter-redis'),
      redisClientOfPeer: packageVersion('redis')
    },
    database: { provisioned: services.provisioned ? 'throwaway (scripts/services.mjs)' : 'DATABASE_URL', settings: database },
    config: CONFIG,
    notes,
    scenarios: Object.fromEntries(summaries.map(({ scenario, rows }) => [scenario.name, {
      description: scenario.description,
      payload: scenario.payload,
      connections: scenario.connections,
      timing: scenario.timing,
      setups: rows
    }])),
    ratios,
    targets,
    runs
  }
  mkdirSync(path.dirname(OUT), { recursive: true })
  writeFileSync(OUT, `${JSON.stringify(result, null, 2)}\n`)
  writeFileSync(CHART, chart(summaries.map(({ scenario, rows }) => ({ name: scenario.name, payload: scenario.payload, connections: scenario.connections, rows })), {
    title: `Throughput relative to bare (req/s ÷ bare's in the same slice of a round; median over ${CONFIG.main.rounds} round(s) × ${CONFIG.main.slices} slice(s)${QUICK ? ', quick mode' : ''})`,
    subtitle: `${result.machine.cores}-core ${result.machine.cpuModel.replace(/\s+/g, ' ').trim()}, ${startedAt.toISOString().slice(0, 10)}; ` +
      `Node ${process.version.slice(1)}, Fastify ${result.versions.fastify}, PostgreSQL ${database.server_version}; POST with a JSON body schema`,
    subtitle2: `PostgreSQL durability: fsync=${database.fsync}, synchronous_commit=${database.synchronous_commit}, full_page_writes=${database.full_page_writes}` +
      `${services.provisioned ? ' (throwaway server: commits not durable)' : ''}`,
    subtitle3: `peer: @node-idempotency/core ${result.versions.peerCore} (benchmarks/peer-glue.ts); storm ${STORM.connections} connections; ` +
      `${CONFIG.main.durationSeconds} s per run (scale scenarios ${CONFIG.scale.durationSeconds} s), all processes on this one machine, ${PIN.pinned ? 'load generator on a CPU of its own' : 'not pinned'}`
  }))
  log(`wrote ${path.relative(process.cwd(), OUT)} and ${path.relative(process.cwd(), CHART)} in ${result.elapsedSeconds} s`)

  const warned = runs.filter((run) => run.warnings.length > 0)
  if (warned.length > 0) log(`${warned.length} run(s) missed a target's count (warnings, not failures): ${warned.map((run) => `${run.scenario}/${run.setup}/${run.round}: ${run.warnings.join('; ')}`).join(' | ')}`)
  const problems = runs.filter((run) => run.problems.length > 0)
  if (problems.length > 0) {
    log(`${problems.length} run(s) had problems: ${problems.map((run) => `${run.scenario}/${run.setup}/${run.round}: ${run.problems.join('; ')}`).join(' | ')}`)
    process.exitCode = 1
  }
} finally {
  await admin`DROP SCHEMA IF EXISTS ${admin(SCHEMA)} CASCADE`.catch(() => {})
  await admin.end({ timeout: 2 })
  PIN.restore()
  await services.stop()
}
