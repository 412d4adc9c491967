/**
 * The second, independent harness (issue 14): `npm run bench:crosscheck [-- --quick] [--rounds n]
 * [--duration s] [--only fresh,replay,storm] [--threads n] [--pin | --unpinned]
 * [--against results.json] [--out file]`.
 *
 * Reproduces run.ts's ratios (benchmarks/ratios.ts) with another load generator and other driving
 * code: wrk (C, epoll, 2 threads; benchmarks/crosscheck.lua makes each request's key), against the
 * same server processes (benchmarks/server.ts, the same SETUPs, schema and pool), pinned as run.ts
 * pins (benchmarks/pinning.ts: wrk on one CPU, the measured side on the others), in rounds: each
 * round runs every scenario, with a new server per setup, each warmed up for 3 s, then the
 * measured load in slices of 1 s that the setups take in turns (measureRound). Each ratio is the
 * median of its slice-pair ratios over every round (ratios.ts slicedRatio), as run.ts's. Then compares each ratio with the latest run.ts result in
 * benchmarks/results/ (by its date, a full run's for a full crosscheck; --against for another) and
 * flags those more than 15% apart. Each ratio is compared twice: of req/s, and per CPU of the
 * measured side (the server, PostgreSQL and Redis; benchmarks/measured-cpu.ts).
 * Every measurement is also checked: no socket error, no status ≥ 400 (but a storm's 409s), one
 * execution per fresh key, none on replays, one per key in a storm.
 *
 * --same-window: every slice is taken twice, by wrk and by autocannon driven as run.ts drives it
 * (benchmarks/autocannon-load.ts, run.ts's keys), one right after the other (which goes first
 * alternates) against the same server, and each ratio is also compared with autocannon's from the
 * same slices. Why: run.ts and this script run minutes apart, and this VM's speed changes between
 * them by more than the ±15% the comparison allows (docs/benchmarks.md "The two generators in the
 * same window"); side by side, slice by slice, a difference is the generators', not the machine's.
 * Writes crosscheck.same-window.json (.quick.json with --quick).
 *
 * --quick: 1 round of 1 s loads, one server per setup serving its scenarios in turn (what
 * test/benchmarks.test.ts runs; its figures only show that it runs).
 *
 * Needs wrk (`.ci/run` installs it); without it the script says how to install it and exits with
 * status 2 (WRK=/path/to/wrk names another binary). Writes benchmarks/results/crosscheck.json
 * (crosscheck.quick.json with --quick). Starts a throwaway PostgreSQL and Redis unless
 * DATABASE_URL and REDIS_URL are set.
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { existsSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import type autocannon from 'autocannon'
import postgres from 'postgres'
import { autocannonLoad, keyed } from './autocannon-load.js'
import { median, RATIOS, ratioName, ratioWithRounds, setupsOf, slicedRatio, type RatioPair, type SliceFigures } from './ratios.js'
import { BODY } from './route.js'
import { startBenchServer, type BenchServer } from './server-process.js'
import { benchServices } from './services.js'
import { cpuMsSince, pinning } from './pinning.js'
import { cpuUsPerRequest, measuredCpuMs, perCpuRatio } from './measured-cpu.js'
import { createBenchSchema, describeDatabase, truncateBenchSchema } from './schema.js'

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const RESULTS = path.join(ROOT, 'benchmarks', 'results')
const LUA = path.join(ROOT, 'benchmarks', 'crosscheck.lua')

const { values: args } = parseArgs({
  options: {
    quick: { type: 'boolean', default: false },
    rounds: { type: 'string' },
    duration: { type: 'string' },
    against: { type: 'string' },
    only: { type: 'string' },
    threads: { type: 'string' },
    pin: { type: 'boolean', default: false },
    unpinned: { type: 'boolean', default: false },
    'same-window': { type: 'boolean', default: false },
    out: { type: 'string' }
  }
})
const QUICK = args.quick === true
const ROUNDS = QUICK ? 1 : Number(args.rounds ?? 5)
if (!Number.isInteger(ROUNDS) || ROUNDS < 1) throw new Error(`--rounds must be a whole number >= 1, received ${args.rounds}`)
/** wrk takes whole seconds: the measured load is cut in slices of 1 s (run.ts's are 1 s too). */
const SLICE_SECONDS = 1
const SECONDS = Number(args.duration ?? (QUICK ? 1 : 4))
if (!Number.isInteger(SECONDS) || SECONDS < 1) throw new Error(`--duration must be a whole number of seconds >= 1, received ${args.duration}`)
/** As long as run.ts's: a new server reaches its steady rate only after seconds of load. */
const WARMUP_SECONDS = QUICK ? 0 : 3
const THREADS = Number(args.threads ?? 2)
if (!Number.isInteger(THREADS) || THREADS < 1) throw new Error(`--threads must be a whole number >= 1, received ${args.threads}`)
const CONNECTIONS = 10
const STORM = { connections: 200, keys: 20 }
const REPLAY_KEYS = 100
const TOLERANCE = 0.15
const SAME_WINDOW = args['same-window'] === true
/** autocannon's warm-up in --same-window, after wrk's: the server is warm by then; this warms autocannon (it runs in this process). */
const AUTOCANNON_WARMUP_SECONDS = QUICK ? 0 : 1
const OUT = args.out ?? path.join(RESULTS, `crosscheck${SAME_WINDOW ? '.same-window' : ''}${QUICK ? '.quick' : ''}.json`)

/** The wrk binary: WRK, or wrk on the PATH. */
const WRK = process.env.WRK ?? 'wrk'
const wrk = spawnSync(WRK, ['--version'], { encoding: 'utf8' })
if (wrk.error !== undefined) {
  process.stderr.write(`[crosscheck] wrk is not installed (${WRK}: ${(wrk.error as NodeJS.ErrnoException).code ?? wrk.error.message}): the crosscheck needs it as its load generator.\n` +
    '[crosscheck] Install it with `apt-get install -y wrk` (Debian/Ubuntu) and run `npm run bench:crosscheck` again.\n')
  process.exit(2)
}
const wrkVersion = `${wrk.stdout}${wrk.stderr}`.split('\n')[0]?.trim() ?? 'wrk'

type Mode = RatioPair['scenario']
interface Measurement {
  round: number
  scenario: Mode
  setup: string
  requestsPerSecond: number
  requests: number
  /** How many wrk runs the measured load was cut into, and each one's req/s and measured CPU µs per request (ratios.ts slicedRatio). */
  slices: number
  sliceRates: number[]
  sliceCpuUsPerRequest: Array<number | null>
  errors: { connect: number, read: number, write: number, status: number, timeout: number }
  p50Us: number
  p99Us: number
  /** The measured side's CPU per request (benchmarks/measured-cpu.ts), µs; null off Linux. */
  measuredCpuUsPerRequest: number | null
  executions: number
  problems: string[]
  /** Problems that fail the run: all but the peer's replay and storm ones, which are its adapter's (peer-glue.ts). */
  failed: boolean
  /** --same-window: autocannon's slices, each taken beside one of wrk's. */
  autocannon: AutocannonFigures | null
}

interface AutocannonFigures {
  requestsPerSecond: number
  requests: number
  sliceRates: number[]
  sliceCpuUsPerRequest: Array<number | null>
  measuredCpuUsPerRequest: number | null
  /** autocannon's own CPU over its slices' wall time: near 1, it bounds the rate it measures. */
  generatorCpuShare: number
  statusCodes: Record<string, number>
  errors: number
}

// --- services and servers -----------------------------------------------------------------------

const children = new Set<ChildProcess>()
const services = await benchServices(() => { for (const child of children) child.kill('SIGKILL') })
/** Pinning (benchmarks/pinning.ts): wrk on its own CPU, as run.ts's autocannon; a full run's default. */
const PIN = pinning(args.pin === true ? 'pin' : args.unpinned === true || QUICK ? 'off' : 'auto')
PIN.moveServices()
const DATABASE_URL = services.databaseUrl
const REDIS_URL = services.redisUrl
const SCHEMA = `cross_${randomBytes(4).toString('hex')}`
const admin = postgres(DATABASE_URL, { max: 1, onnotice: () => {} })

/** A benchmark server (server.ts) for `setup`; resolves once it listens. */
function serve (setup: string): Promise<BenchServer> {
  return startBenchServer({
    pin: PIN,
    env: { SETUP: setup, DATABASE_URL, REDIS_URL, BENCH_SCHEMA: SCHEMA, BENCH_POOL_MAX: '10', BENCH_PAYLOAD: '200' },
    label: setup,
    running: children
  })
}

async function executions (url: string): Promise<number> {
  return ((await (await fetch(`${url}/stats`)).json()) as { executions: number }).executions
}

/** Numbers the wrk runs: each run's fresh keys are its own (crosscheck.lua). */
let wrkRuns = 0

/** One wrk run: its summary line (crosscheck.lua's done()). */
interface WrkRun { requests: number, durationUs: number, errors: Measurement['errors'], p50Us: number, p99Us: number }

function runWrk (url: string, mode: Mode, tag: string, seconds: number, connections: number): Promise<WrkRun> {
  return new Promise((resolve, reject) => {
    const [command, argv] = PIN.generator(WRK, ['-t', String(THREADS), '-c', String(connections), '-d', `${seconds}s`, '--timeout', '10s', '-s', LUA, `${url}/pay`])
    const child = spawn(command, argv, {
      env: { ...process.env, CROSSCHECK_MODE: mode, CROSSCHECK_TAG: tag, CROSSCHECK_RUN: String(wrkRuns++), CROSSCHECK_KEYS: String(mode === 'storm' ? STORM.keys : REPLAY_KEYS), CROSSCHECK_BODY: BODY },
      stdio: ['ignore', 'pipe', 'inherit']
    })
    children.add(child)
    let output = ''
    child.stdout.on('data', (chunk: Buffer) => { output += chunk.toString() })
    child.once('exit', (code) => {
      children.delete(child)
      const line = /^CROSSCHECK (\{.*\})$/m.exec(output)?.[1]
      if (code !== 0 || line === undefined) return reject(new Error(`wrk exited with ${code}: ${output}`))
      const s = JSON.parse(line) as { requests: number, durationUs: number, connect: number, read: number, write: number, status: number, timeout: number, p50Us: number, p99Us: number }
      resolve({
        requests: s.requests,
        durationUs: s.durationUs,
        errors: { connect: s.connect, read: s.read, write: s.write, status: s.status, timeout: s.timeout },
        p50Us: s.p50Us,
        p99Us: s.p99Us
      })
    })
  })
}

/** The keys a replay measurement cycles over, completed through the server before it is loaded. */
async function completeReplayKeys (url: string, tag: string): Promise<void> {
  for (let i = 0; i < REPLAY_KEYS; i++) {
    const response = await fetch(`${url}/pay`, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': `"r-${i}-${tag}"` }, body: BODY })
    await response.arrayBuffer()
    if (response.status !== 201) throw new Error(`completing replay key ${i}: ${response.status}`)
  }
}

type Server = BenchServer

/** autocannon's side of a measurement in --same-window. */
interface AutocannonMeasuring { requests: autocannon.Request[], slices: autocannon.Result[], sliceCpuMs: Array<number | null>, generatorCpuMs: number }

/** One setup's measurement in progress: warmed up, then loaded slice by slice (interleaved with the other setups'). */
interface Measuring { scenario: Mode, setup: string, server: Server, tag: string, connections: number, initial: number, before: number, runs: WrkRun[], sliceCpuMs: Array<number | null>, autocannon: AutocannonMeasuring | null }

let autocannonFreshKeys = 0
/**
 * autocannon's requests for a measurement: run.ts's stream for the scenario. Replays and the storm
 * use the keys wrk uses (crosscheck.lua: the same completed keys, the same storm keys, so a storm
 * still executes each key once); fresh keys are autocannon's own.
 */
function autocannonRequests (scenario: Mode, tag: string): autocannon.Request[] {
  let i = 0
  if (scenario === 'fresh') return keyed(() => `"a-${tag}-${autocannonFreshKeys++}"`)
  if (scenario === 'replay') return keyed(() => `"r-${i++ % REPLAY_KEYS}-${tag}"`)
  return keyed(() => `"s-${i++ % STORM.keys}-${tag}"`)
}

async function warmUp (scenario: Mode, setup: string, server: Server): Promise<Measuring> {
  const tag = randomBytes(4).toString('hex')
  const connections = scenario === 'storm' ? STORM.connections : CONNECTIONS
  if (scenario === 'replay') await completeReplayKeys(server.url, tag)
  const initial = await executions(server.url)
  if (WARMUP_SECONDS > 0) await runWrk(server.url, scenario, tag, WARMUP_SECONDS, connections)
  const ac = SAME_WINDOW ? { requests: autocannonRequests(scenario, tag), slices: [], sliceCpuMs: [], generatorCpuMs: 0 } : null
  if (ac !== null && AUTOCANNON_WARMUP_SECONDS > 0) await autocannonLoad(server.url, ac.requests, AUTOCANNON_WARMUP_SECONDS, connections)
  return { scenario, setup, server, tag, connections, initial, before: await executions(server.url), runs: [], sliceCpuMs: [], autocannon: ac }
}

async function wrkSlice (m: Measuring, seconds: number): Promise<void> {
  const cpuStart = measuredCpuMs(m.server.pid)
  m.runs.push(await runWrk(m.server.url, m.scenario, m.tag, seconds, m.connections))
  const cpuEnd = measuredCpuMs(m.server.pid)
  m.sliceCpuMs.push(cpuStart === null || cpuEnd === null ? null : cpuEnd - cpuStart)
}

async function autocannonSlice (m: Measuring, ac: AutocannonMeasuring, seconds: number): Promise<void> {
  const cpuStart = measuredCpuMs(m.server.pid)
  const generatorStart = process.cpuUsage()
  ac.slices.push(await autocannonLoad(m.server.url, ac.requests, seconds, m.connections))
  ac.generatorCpuMs += cpuMsSince(generatorStart)
  const cpuEnd = measuredCpuMs(m.server.pid)
  ac.sliceCpuMs.push(cpuStart === null || cpuEnd === null ? null : cpuEnd - cpuStart)
}

/** One slice of the measured load: wrk's, and in --same-window autocannon's beside it (the `slice`-th: which goes first alternates). */
async function loadSlice (m: Measuring, seconds: number, slice: number): Promise<void> {
  const ac = m.autocannon
  if (ac === null) return wrkSlice(m, seconds)
  if (slice % 2 === 0) {
    await wrkSlice(m, seconds)
    await autocannonSlice(m, ac, seconds)
  } else {
    await autocannonSlice(m, ac, seconds)
    await wrkSlice(m, seconds)
  }
}

const sum = (values: readonly number[]): number => values.reduce((a, b) => a + b, 0)

async function finish (m: Measuring, round: number): Promise<Measurement> {
  const { scenario, setup, connections } = m
  const after = await executions(m.server.url)
  const requests = sum(m.runs.map((r) => r.requests))
  const errors = { connect: 0, read: 0, write: 0, status: 0, timeout: 0 }
  for (const run of m.runs) for (const name of Object.keys(errors) as Array<keyof typeof errors>) errors[name] += run.errors[name]
  const problems: string[] = []
  const { connect, read, write, timeout, status } = errors
  if (connect + read + write + timeout > 0) problems.push(`socket errors ${JSON.stringify(errors)}`)
  if (status > 0 && scenario !== 'storm') problems.push(`${status} responses with a status ≥ 400`)
  const executed = after - m.before
  const ac = m.autocannon
  const acRequests = ac === null ? 0 : sum(ac.slices.map((r) => r.requests.total))
  const statusCodes: Record<string, number> = {}
  for (const slice of ac?.slices ?? []) {
    for (const [code, stat] of Object.entries(slice.statusCodeStats ?? {})) statusCodes[code] = (statusCodes[code] ?? 0) + (stat.count ?? 0)
  }
  const acErrors = ac === null ? 0 : sum(ac.slices.map((r) => r.errors + r.timeouts))
  if (acErrors > 0) problems.push(`autocannon: ${acErrors} errors or timeouts`)
  const acUnexpected = Object.entries(statusCodes).filter(([code, count]) => count > 0 && !code.startsWith('2') && !(scenario === 'storm' && code === '409'))
  if (acUnexpected.length > 0) problems.push(`autocannon: answers ${JSON.stringify(Object.fromEntries(acUnexpected))}`)
  if (setup !== 'bare') {
    // A load stops with requests in flight, which still execute: up to one per connection, per slice.
    const slices = m.runs.length + (ac?.slices.length ?? 0)
    if (scenario === 'fresh' && Math.abs(executed - requests - acRequests) > (slices + 1) * connections) problems.push(`${executed} executions for ${requests + acRequests} fresh keys`)
    if (scenario === 'replay' && executed !== 0) problems.push(`${executed} executions during replays`)
    if (scenario === 'storm' && after - m.initial !== STORM.keys) problems.push(`${after - m.initial} executions for ${STORM.keys} keys`)
  }
  // The peer's adapter runs the handler for a replay whose client disconnected (peer-glue.ts):
  // reported, not a failure of the harness.
  const tolerated = setup.startsWith('peer-') && scenario !== 'fresh'
  return {
    round,
    scenario,
    setup,
    requestsPerSecond: Math.round(requests / (sum(m.runs.map((r) => r.durationUs)) / 1e6)),
    requests,
    slices: m.runs.length,
    errors,
    // wrk's percentiles cannot be merged across slices: the median slice's.
    p50Us: median(m.runs.map((r) => r.p50Us)),
    p99Us: median(m.runs.map((r) => r.p99Us)),
    sliceRates: m.runs.map((r) => Math.round(r.requests / (r.durationUs / 1e6))),
    sliceCpuUsPerRequest: m.runs.map((r, i) => cpuUsPerRequest(0, m.sliceCpuMs[i] ?? null, r.requests)),
    measuredCpuUsPerRequest: m.sliceCpuMs.includes(null) ? null : cpuUsPerRequest(0, sum(m.sliceCpuMs as number[]), requests),
    executions: executed,
    problems: tolerated ? problems.map((p) => `${p} (the peer's adapter: see peer-glue.ts)`) : problems,
    failed: problems.length > 0 && !tolerated,
    autocannon: ac === null ? null : autocannonFigures(ac, acRequests, statusCodes, acErrors)
  }
}

function autocannonFigures (ac: AutocannonMeasuring, requests: number, statusCodes: Record<string, number>, errors: number): AutocannonFigures {
  const seconds = sum(ac.slices.map((r) => r.duration))
  return {
    requestsPerSecond: Math.round(requests / seconds),
    requests,
    sliceRates: ac.slices.map((r) => Math.round(r.requests.total / r.duration)),
    sliceCpuUsPerRequest: ac.slices.map((r, i) => cpuUsPerRequest(0, ac.sliceCpuMs[i] ?? null, r.requests.total)),
    measuredCpuUsPerRequest: ac.sliceCpuMs.includes(null) ? null : cpuUsPerRequest(0, sum(ac.sliceCpuMs as number[]), requests),
    generatorCpuShare: Math.round(ac.generatorCpuMs / (seconds * 1000) * 100) / 100,
    statusCodes,
    errors
  }
}

/**
 * One round of a scenario: a new server per setup, all started together, each warmed up in turn,
 * then the measured load in slices of SLICE_SECONDS that the setups take in turns (the first to go
 * rotating), as run.ts does, so that a change in the machine's speed falls on every setup alike.
 */
async function measureRound (round: number, scenario: Mode, setups: string[], record: (m: Measurement) => void): Promise<void> {
  await truncateBenchSchema(admin, SCHEMA)
  const servers: Server[] = []
  try {
    for (const setup of setups) servers.push(await serve(setup))
    const measuring: Measuring[] = []
    for (let i = 0; i < setups.length; i++) measuring.push(await warmUp(scenario, setups[i]!, servers[i]!))
    const slices = Math.max(1, Math.round(SECONDS / SLICE_SECONDS))
    for (let slice = 0; slice < slices; slice++) {
      for (let turn = 0; turn < measuring.length; turn++) await loadSlice(measuring[(slice + turn) % measuring.length]!, SLICE_SECONDS, slice)
    }
    for (const m of measuring) record(await finish(m, round))
  } finally {
    await Promise.allSettled(servers.map((server) => server.stop()))
  }
}

/**
 * Every measurement, in order: each round runs every scenario (measureRound).
 * --quick: one server per setup, serving its scenarios in turn (tables emptied in between), one slice each.
 */
async function measureAll (plan: Array<{ scenario: Mode, setups: string[] }>, onMeasured: (m: Measurement) => void): Promise<Measurement[]> {
  const measurements: Measurement[] = []
  const record = (m: Measurement): void => { measurements.push(m); onMeasured(m) }
  if (QUICK) {
    const setups = [...new Set(plan.flatMap((p) => p.setups))]
    for (const setup of setups) {
      const server = await serve(setup)
      try {
        for (const { scenario } of plan.filter((p) => p.setups.includes(setup))) {
          await truncateBenchSchema(admin, SCHEMA)
          const m = await warmUp(scenario, setup, server)
          await loadSlice(m, SECONDS, 0)
          record(await finish(m, 1))
        }
      } finally {
        await server.stop()
      }
    }
    return measurements
  }
  for (let round = 1; round <= ROUNDS; round++) {
    for (const { scenario, setups } of plan) await measureRound(round, scenario, setups, record)
  }
  return measurements
}

// --- the comparison ------------------------------------------------------------------------------

/** A run.ts result's ratios by name: of req/s (`ratios`) and per CPU of the measured side (`cpuRatios`). */
interface RunTsResult { path: string, date: string, quick: boolean, ratios: Map<string, number>, cpuRatios: Map<string, number> }

/** The latest run.ts result (by its date; a full one for a full crosscheck), or --against. */
function latestRunTs (): RunTsResult | null {
  const files = args.against !== undefined
    ? [path.resolve(args.against)]
    : existsSync(RESULTS) ? readdirSync(RESULTS).filter((f) => f.endsWith('.json')).map((f) => path.join(RESULTS, f)) : []
  const found: RunTsResult[] = []
  for (const file of files) {
    let json: { benchmark?: string, date?: string, quick?: boolean, ratios?: Array<{ name: string, ratio: number | null, cpuRatio?: number | null }>, scenarios?: Record<string, { setups: Array<{ setup: string, ratioTo?: Record<string, number>, cpuRatioTo?: Record<string, number> }> }> }
    try { json = JSON.parse(readFileSync(file, 'utf8')) } catch { continue }
    if (json.benchmark !== 'postgres' || typeof json.date !== 'string') continue
    const ratios = new Map<string, number>()
    const cpuRatios = new Map<string, number>()
    for (const pair of RATIOS) {
      const listed = json.ratios?.find((r) => r.name === ratioName(pair))
      const row = json.scenarios?.[pair.scenario]?.setups.find((r) => r.setup === pair.setup)
      const value = listed?.ratio ?? row?.ratioTo?.[pair.to]
      const cpu = listed?.cpuRatio ?? row?.cpuRatioTo?.[pair.to]
      if (typeof value === 'number') ratios.set(ratioName(pair), value)
      if (typeof cpu === 'number') cpuRatios.set(ratioName(pair), cpu)
    }
    found.push({ path: file, date: json.date, quick: json.quick === true, ratios, cpuRatios })
  }
  // A full crosscheck is compared with a full run when there is one, not with a later quick one.
  const comparable = QUICK ? found : found.filter((r) => !r.quick)
  const candidates = comparable.length > 0 ? comparable : found
  candidates.sort((a, b) => b.date.localeCompare(a.date))
  return candidates[0] ?? null
}

function pad (rows: string[][]): string {
  const widths = rows[0]!.map((_, i) => Math.max(...rows.map((r) => r[i]!.length)))
  const line = (cells: string[]): string => `| ${cells.map((c, i) => i === 0 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!)).join(' | ')} |`
  return [line(rows[0]!), `|${widths.map((w, i) => i === 0 ? `:${'-'.repeat(w + 1)}` : `${'-'.repeat(w + 1)}:`).join('|')}|`, ...rows.slice(1).map(line)].join('\n')
}

interface RatioFigures extends RatioPair { name: string, ratio: number | null, byRound: number[], cpuRatio: number | null, cpuByRound: number[] }

/** One ratio of wrk's against another measurement's (run.ts's, or autocannon's in the same slices). */
interface Compared { name: string, crosscheck: number | null, runTs: number | null, difference: number | null, flagged: boolean, cpuCrosscheck: number | null, cpuRunTs: number | null, cpuDifference: number | null, cpuFlagged: boolean }

const differenceOf = (mine: number | null, theirs: number | null): number | null =>
  mine === null || theirs === null ? null : Math.round((mine / theirs - 1) * 1000) / 1000

/** wrk's ratios against `theirs` (of req/s) and `theirsPerCpu`; `runTs` is the other side (named for run.ts, the first it was compared with). */
function compare (ratios: readonly RatioFigures[], theirs: (name: string) => number | null, theirsPerCpu: (name: string) => number | null): Compared[] {
  return ratios.map((r) => {
    const other = theirs(r.name)
    const difference = differenceOf(r.ratio, other)
    const cpuOther = theirsPerCpu(r.name)
    const cpuDifference = differenceOf(r.cpuRatio, cpuOther)
    return {
      name: r.name,
      crosscheck: r.ratio,
      runTs: other,
      difference,
      flagged: difference !== null && Math.abs(difference) > TOLERANCE,
      cpuCrosscheck: r.cpuRatio,
      cpuRunTs: cpuOther,
      cpuDifference,
      cpuFlagged: cpuDifference !== null && Math.abs(cpuDifference) > TOLERANCE
    }
  })
}

function describeComparison (comparison: readonly Compared[]): string {
  const flagged = comparison.filter((c) => c.flagged)
  const compared = comparison.filter((c) => c.difference !== null)
  const cpuFlagged = comparison.filter((c) => c.cpuFlagged)
  const cpuCompared = comparison.filter((c) => c.cpuDifference !== null)
  return `of req/s, ${compared.length - flagged.length} of ${compared.length} ratios agree within ±${TOLERANCE * 100}%${flagged.length > 0 ? ` (${flagged.length} differ: ${flagged.map((c) => c.name).join(', ')})` : ''}; ` +
    `per CPU of the measured side, ${cpuCompared.length - cpuFlagged.length} of ${cpuCompared.length}${cpuFlagged.length > 0 ? ` (${cpuFlagged.length} differ: ${cpuFlagged.map((c) => c.name).join(', ')})` : ''}`
}

function comparisonTable (comparison: readonly Compared[]): string {
  const percent = (d: number | null): string => d === null ? '—' : `${d >= 0 ? '+' : ''}${(d * 100).toFixed(1)}%`
  const verdict = (d: number | null, flagged: boolean): string => d === null ? 'not compared' : flagged ? `DIFFERS by more than ${TOLERANCE * 100}%` : 'agrees'
  const rows = [['ratio', 'req/s: wrk', 'autocannon', 'difference', '', 'per CPU: wrk', 'autocannon', 'difference', '']]
  for (const c of comparison) {
    rows.push([c.name, c.crosscheck?.toFixed(3) ?? '—', c.runTs?.toFixed(3) ?? '—', percent(c.difference), verdict(c.difference, c.flagged),
      c.cpuCrosscheck?.toFixed(3) ?? '—', c.cpuRunTs?.toFixed(3) ?? '—', percent(c.cpuDifference), verdict(c.cpuDifference, c.cpuFlagged)])
  }
  return pad(rows)
}

// --- main ---------------------------------------------------------------------------------------

const log = (message: string): void => { process.stderr.write(`[crosscheck] ${message}\n`) }
const startedAt = new Date()
try {
  await createBenchSchema(admin, SCHEMA)
  const database = await describeDatabase(admin)
  const only = args.only?.split(',').map((s) => s.trim())
  const plan: Array<{ scenario: Mode, setups: string[] }> = (['fresh', 'replay', 'storm'] as const)
    .filter((scenario) => only === undefined || only.includes(scenario))
    .map((scenario) => ({ scenario, setups: setupsOf(scenario) }))
  log(`${wrkVersion}; ${ROUNDS} round(s), ${WARMUP_SECONDS} s warm-up + ${SECONDS} s in slices of ${SLICE_SECONDS} s per measurement, ${THREADS} threads, ${CONNECTIONS} connections (storm ${STORM.connections}); ${PIN.description}`)
  const measurements = await measureAll(plan, (m) => {
    log(`round ${m.round} ${m.scenario} ${m.setup}: ${m.requestsPerSecond.toLocaleString('en-US')} req/s${m.problems.length > 0 ? `  PROBLEM: ${m.problems.join('; ')}` : ''}`)
  })

  const find = (round: number, scenario: Mode, setup: string): Measurement | undefined => measurements.find((m) => m.round === round && m.scenario === scenario && m.setup === setup)
  /** One generator's figures of a measurement: wrk's (the measurement's own) or autocannon's (--same-window). */
  type Figures = Pick<Measurement, 'requestsPerSecond' | 'sliceRates' | 'sliceCpuUsPerRequest' | 'measuredCpuUsPerRequest'>
  const ratiosOf = (pick: (m: Measurement) => Figures | null): RatioFigures[] => RATIOS.map((pair) => {
    const figures = (round: number, setup: string): Figures | null => { const m = find(round, pair.scenario, setup); return m === undefined ? null : pick(m) }
    const byRound: number[] = []
    const cpuByRound: number[] = []
    for (let round = 1; round <= ROUNDS; round++) {
      const a = figures(round, pair.setup)
      const b = figures(round, pair.to)
      if (a === null || b === null) continue
      byRound.push(Math.round(a.requestsPerSecond / b.requestsPerSecond * 1000) / 1000)
      const perCpu = perCpuRatio(a.measuredCpuUsPerRequest, b.measuredCpuUsPerRequest)
      if (perCpu !== null) cpuByRound.push(perCpu)
    }
    const slicesOf = (setup: string, of: (f: Figures) => ReadonlyArray<number | null>): SliceFigures =>
      Array.from({ length: ROUNDS }, (_, i) => { const f = figures(i + 1, setup); return f === null ? [] : of(f) })
    const rates = (setup: string): SliceFigures => slicesOf(setup, (f) => f.sliceRates)
    const cpu = (setup: string): SliceFigures => slicesOf(setup, (f) => f.sliceCpuUsPerRequest)
    return { ...pair, name: ratioName(pair), ratio: slicedRatio(rates(pair.setup), rates(pair.to)), byRound, cpuRatio: slicedRatio(cpu(pair.setup), cpu(pair.to), true), cpuByRound }
  })
  const ratios = ratiosOf((m) => m)
  const autocannonRatios = SAME_WINDOW ? ratiosOf((m) => m.autocannon) : null

  const rows = [['scenario / setup', 'req/s (median)', 'p50 µs', 'p99 µs', 'CPU µs/req', 'req/s by round', ...SAME_WINDOW ? ['autocannon req/s', 'CPU µs/req', 'its CPU share'] : []]]
  for (const { scenario, setups } of plan) {
    for (const setup of setups) {
      const mine = measurements.filter((m) => m.scenario === scenario && m.setup === setup)
      const theirs = mine.flatMap((m) => m.autocannon === null ? [] : [m.autocannon])
      rows.push([`${scenario} / ${setup}`, Math.round(median(mine.map((m) => m.requestsPerSecond))).toLocaleString('en-US'),
        String(median(mine.map((m) => m.p50Us))), String(median(mine.map((m) => m.p99Us))),
        String(Math.round(median(mine.map((m) => m.measuredCpuUsPerRequest ?? NaN)))), mine.map((m) => m.requestsPerSecond.toLocaleString('en-US')).join(' '),
        ...SAME_WINDOW
          ? [Math.round(median(theirs.map((a) => a.requestsPerSecond))).toLocaleString('en-US'), String(Math.round(median(theirs.map((a) => a.measuredCpuUsPerRequest ?? NaN)))), median(theirs.map((a) => a.generatorCpuShare)).toFixed(2)]
          : []])
    }
  }

  const reference = latestRunTs()
  const comparison = compare(ratios, (name) => reference?.ratios.get(name) ?? null, (name) => reference?.cpuRatios.get(name) ?? null)
  const sameWindow = autocannonRatios === null
    ? null
    : compare(ratios, (name) => autocannonRatios.find((r) => r.name === name)?.ratio ?? null, (name) => autocannonRatios.find((r) => r.name === name)?.cpuRatio ?? null)
  process.stdout.write([
    `crosscheck: wrk${SAME_WINDOW ? ', and autocannon in the same slices,' : ''} against benchmarks/server.ts, ${ROUNDS} round(s), ratios the medians of slice-pair ratios (then each round's own)${QUICK ? ' (quick mode: figures only show that it runs)' : ''}`,
    pad(rows),
    ['ratios of wrk (of req/s; per CPU of the measured side):', ...ratios.map((r) => `- ${r.name}: ${ratioWithRounds(r.ratio, r.byRound)}; ${ratioWithRounds(r.cpuRatio, r.cpuByRound)}`)].join('\n'),
    ...sameWindow === null ? [] : [`comparison with autocannon in the same slices: ${describeComparison(sameWindow)}\n${comparisonTable(sameWindow)}`],
    reference === null
      ? 'comparison: no run.ts result in benchmarks/results/ (run `npm run bench` first, or pass --against)'
      : `comparison with run.ts (${path.relative(ROOT, reference.path)}, ${reference.date}${reference.quick ? ', a quick run' : ''}): ${describeComparison(comparison)}\n${comparisonTable(comparison)}`
  ].join('\n\n') + '\n')

  mkdirSync(path.dirname(OUT), { recursive: true })
  writeFileSync(OUT, `${JSON.stringify({
    benchmark: 'crosscheck',
    date: startedAt.toISOString(),
    quick: QUICK,
    elapsedSeconds: Math.round((Date.now() - startedAt.getTime()) / 1000),
    machine: { cpuModel: os.cpus()[0]?.model ?? 'unknown', cores: os.cpus().length, loadAverageAtStart: os.loadavg() },
    versions: { node: process.version, wrk: wrkVersion, postgresServer: database.server_version },
    config: { rounds: ROUNDS, seconds: SECONDS, warmupSeconds: WARMUP_SECONDS, threads: THREADS, connections: CONNECTIONS, storm: STORM, replayKeys: REPLAY_KEYS, tolerance: TOLERANCE, pinning: PIN.description, sameWindow: SAME_WINDOW, autocannonWarmupSeconds: SAME_WINDOW ? AUTOCANNON_WARMUP_SECONDS : null },
    reference: reference === null ? null : { path: path.relative(ROOT, reference.path), date: reference.date, quick: reference.quick },
    ratios,
    comparison,
    autocannonRatios,
    // The same comparison, named for its two sides.
    sameWindow: sameWindow?.map(({ crosscheck, runTs, cpuCrosscheck, cpuRunTs, ...rest }) => ({ ...rest, wrk: crosscheck, autocannon: runTs, cpuWrk: cpuCrosscheck, cpuAutocannon: cpuRunTs })) ?? null,
    measurements
  }, null, 2)}\n`)
  log(`wrote ${path.relative(process.cwd(), OUT)} in ${Math.round((Date.now() - startedAt.getTime()) / 1000)} s`)
  const failed = measurements.filter((m) => m.failed)
  if (failed.length > 0) {
    log(`${failed.length} measurement(s) had problems:\n${failed.map((m) => `  round ${m.round} ${m.scenario} ${m.setup}: ${m.problems.join('; ')}`).join('\n')}`)
    process.exitCode = 1
  }
} finally {
  await admin`DROP SCHEMA IF EXISTS ${admin(SCHEMA)} CASCADE`.catch(() => {})
  await admin.end({ timeout: 2 })
  PIN.restore()
  await services.stop()
}
