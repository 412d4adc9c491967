/**
 * The Postgres driver's benchmark (issue 3): `node --import tsx benchmarks/run.ts [--quick] [--out file]`.
 *
 * Starts a throwaway PostgreSQL (scripts/services.mjs) unless DATABASE_URL is set, migrates a fresh
 * schema, and measures each scenario with its setups interleaved (A B C … A B C …) so that the
 * machine's drift hits every setup alike. Each measurement gets its own server process
 * (benchmarks/server.ts) on a loopback port and loads it from this process with autocannon's
 * programmatic API. Reports medians over the rounds, and ratios taken within a round (to `bare`,
 * and for the Postgres setups to `floor-sql`): req/s, the server's own latency in microseconds
 * (p50/p99/p99.9, hrtime from onRequest to onResponse; GET /stats) and autocannon's client-side
 * latency in whole milliseconds. Prints a table and writes benchmarks/results/postgres.json
 * (postgres.quick.json with --quick, so a development run never overwrites the published figures)
 * and benchmarks/results/chart.svg (chart.quick.svg with --quick): req/s ratio to bare per setup
 * and scenario. The peer (@node-idempotency/core) runs through benchmarks/peer-glue.ts.
 *
 * Extending it (issue 5): a setup is a name here plus an entry in server.ts's SETUPS; a scenario is
 * an entry in SCENARIOS (its setups, its request stream, what it prepares and checks).
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import autocannon from 'autocannon'
import postgres from 'postgres'
import { migrate } from '../drivers/postgres/index.js'

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const SERVER = path.join(ROOT, 'benchmarks', 'server.ts')

const { values: args } = parseArgs({ options: { quick: { type: 'boolean', default: false }, out: { type: 'string' } } })
const QUICK = args.quick === true
const OUT = args.out ?? path.join(ROOT, 'benchmarks', 'results', QUICK ? 'postgres.quick.json' : 'postgres.json')
const CHART = path.join(path.dirname(OUT), QUICK ? 'chart.quick.svg' : 'chart.svg')
/** Read before anything runs: a busy machine skews every figure. */
const loadAverageAtStart = os.loadavg()
const CONFIG = {
  rounds: QUICK ? 1 : 3,
  connections: 10,
  durationSeconds: QUICK ? 0.8 : 4,
  // Unmeasured load on each new server first: JIT, the pool's connections, prepared statements.
  warmupSeconds: QUICK ? 0.3 : 1,
  poolMax: 10,
  replayKeys: 100
} as const

const SETUPS = ['bare', 'memory', 'peer-memory', 'pg-lease', 'pg-atomic', 'pg-redis', 'peer-redis', 'floor-sql'] as const
type Setup = typeof SETUPS[number]
const PG_SETUPS: ReadonlySet<Setup> = new Set(['pg-lease', 'pg-atomic', 'pg-redis', 'floor-sql'])
/** The duplicate storm: many connections on few keys, each key hammered concurrently (issue 5). */
const STORM = { connections: 200, keys: 20 } as const
/** The response body's sizes (server.ts's BENCH_PAYLOAD): the ~200-byte payment, and one padded to 64 KiB. */
const SMALL = 200
const LARGE = 65_536
/** The 64 KiB scenarios run only these, to bound the run's time. */
const LARGE_SETUPS: readonly Setup[] = ['bare', 'memory', 'peer-memory', 'pg-lease']
/** The setups whose calls to their store are counted (round trips; the memory stores' are not). */
const COUNTED: ReadonlySet<Setup> = new Set(['pg-lease', 'pg-redis', 'peer-redis'])

const BODY = '{"amount":1000,"currency":"EUR"}'

interface Run {
  scenario: string
  round: number
  setup: Setup
  requestsPerSecond: number
  requests: number
  durationSeconds: number
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
  /** Calls that reached the store during the measured load, per request (setups that count them). */
  storeCallsPerRequest: number | null
  peakRssMiB: number
  ratioToBare: number | null
  ratioToFloor: number | null
  problems: string[]
}

interface Latency { samples: number, p50: number, p99: number, p99_9: number }

interface Scenario {
  name: string
  description: string
  /** The response body's size in bytes (BENCH_PAYLOAD). */
  payload: number
  setups: readonly Setup[]
  /** Runs once against each new server, before its warm-up. */
  prepare?: (url: string, tag: string) => Promise<void>
  /** autocannon's request list; `tag` is unique to the measurement. */
  requests: (tag: string) => autocannon.Request[]
  /** Connections of this scenario's load (CONFIG.connections otherwise). */
  connections?: number
  /** Statuses that are a correct answer here besides 2xx (a storm's 409s). */
  allowedNon2xx?: readonly number[]
  /** What must hold of a measured run (beyond 0 errors): returns the problems. */
  check: (run: Run) => string[]
}

/** A request whose idempotency-key header `key()` picks anew each time autocannon sends it. */
function keyed (key: () => string): autocannon.Request[] {
  return [{
    method: 'POST',
    path: '/pay',
    setupRequest (request) {
      (request.headers ??= {})['idempotency-key'] = key()
      return request
    }
  }]
}

/** Shared by the warm-up and the measured load, so a key is never sent twice. */
let freshCounter = 0
const replayKey = (i: number, tag: string): string => `"r-${i}-${tag}"`

function fresh (name: string, payload: number, setups: readonly Setup[]): Scenario {
  return {
    name,
    description: `every request a new key; ${describePayload(payload)}`,
    payload,
    setups,
    requests: (tag) => keyed(() => `"k-${freshCounter++}-${tag}"`),
    // A request in flight when a load stops still executes, uncounted: up to one per connection
    // after the warm-up (counted here) and after the measured load (not counted here).
    check: (run) => Math.abs(run.executions - run.requests) <= 2 * CONFIG.connections
      ? []
      : [`${run.executions} executions for ${run.requests} fresh keys`]
  }
}

function describePayload (bytes: number): string {
  return bytes >= 1024 ? `${Math.round(bytes / 1024)} KiB responses` : `${bytes}-byte responses`
}

function replay (name: string, payload: number, setups: readonly Setup[]): Scenario {
  return {
    name,
    description: `requests cycle over ${CONFIG.replayKeys} keys completed beforehand; ${describePayload(payload)}`,
    payload,
    setups,
    async prepare (url, tag) {
      for (let i = 0; i < CONFIG.replayKeys; i += CONFIG.connections) {
        await Promise.all(Array.from({ length: Math.min(CONFIG.connections, CONFIG.replayKeys - i) }, async (_, j) => {
          const response = await fetch(`${url}/pay`, {
            method: 'POST',
            headers: { 'content-type': 'application/json', 'idempotency-key': replayKey(i + j, tag) },
            body: BODY
          })
          await response.arrayBuffer()
          if (response.status !== 201) throw new Error(`replay warm-up: key ${i + j} answered ${response.status}`)
        }))
      }
    },
    requests (tag) {
      let i = 0
      return keyed(() => replayKey(i++ % CONFIG.replayKeys, tag))
    },
    // bare has no idempotency: it executes every request.
    check: (run) => run.setup === 'bare' || run.executions === 0 ? [] : [`${run.executions} executions during replays`]
  }
}

const SCENARIOS: readonly Scenario[] = [
  fresh('fresh', SMALL, SETUPS),
  replay('replay', SMALL, SETUPS),
  {
    name: 'storm',
    description: `${STORM.connections} connections hammering ${STORM.keys} keys (duplicates: 409 while in flight, then replays); ${describePayload(SMALL)}`,
    payload: SMALL,
    setups: ['bare', 'pg-lease', 'pg-redis', 'peer-redis'],
    connections: STORM.connections,
    allowedNon2xx: [409],
    requests (tag) {
      let i = 0
      return keyed(() => `"s-${i++ % STORM.keys}-${tag}"`)
    },
    check: (run) => run.setup === 'bare' || run.executionsWithWarmup === STORM.keys
      ? []
      : [`${run.executionsWithWarmup} executions for ${STORM.keys} keys`]
  },
  fresh('fresh-64k', LARGE, LARGE_SETUPS),
  replay('replay-64k', LARGE, LARGE_SETUPS)
]

// --- the database -----------------------------------------------------------------------------

interface Services { env: Record<string, string>, stop: (() => Promise<void>) & { sync: () => void } }
let services: Services | null = null
let server: ChildProcess | null = null
// Synchronous teardown on any exit (services' stop.sync), so ^C leaves no PostgreSQL behind.
process.once('exit', () => { server?.kill('SIGKILL'); services?.stop.sync() })
process.once('SIGINT', () => process.exit(130))
process.once('SIGTERM', () => process.exit(143))

if (!process.env.DATABASE_URL || !process.env.REDIS_URL) {
  // It starts only what is not already given by DATABASE_URL / REDIS_URL.
  // Imported through a computed specifier: services.mjs is plain JS without type declarations.
  const { startServices } = await import(new URL('../scripts/services.mjs', import.meta.url).href) as {
    startServices: (options: { redis: boolean, redisCluster: boolean }) => Promise<Services>
  }
  services = await startServices({ redis: true, redisCluster: false })
}
const DATABASE_URL = services?.env.DATABASE_URL ?? process.env.DATABASE_URL ?? ''
const REDIS_URL = services?.env.REDIS_URL ?? process.env.REDIS_URL ?? ''
const SCHEMA = `bench_${randomBytes(4).toString('hex')}`
const admin = postgres(DATABASE_URL, { max: 2, onnotice: () => {} })

async function createSchema (): Promise<void> {
  await admin`CREATE SCHEMA ${admin(SCHEMA)}`
  // Both record tables from the driver's own migration, so floor-sql writes the very same shape.
  await migrate(admin, { schema: SCHEMA, table: 'records' })
  await migrate(admin, { schema: SCHEMA, table: 'floor_records' })
  await admin`
    CREATE TABLE ${admin(SCHEMA)}.payments (
      id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
      idempotency_key text NOT NULL,
      amount integer NOT NULL,
      currency text NOT NULL,
      created_at timestamptz NOT NULL DEFAULT now()
    )`
}

async function describeDatabase (): Promise<Record<string, string>> {
  const settings = await admin`
    SELECT name, current_setting(name) AS setting FROM pg_settings
    WHERE name IN ('server_version', 'fsync', 'synchronous_commit', 'full_page_writes', 'shared_buffers', 'max_connections')`
  return Object.fromEntries(settings.map((row) => [String(row.name), String(row.setting)]))
}

// --- one measurement ----------------------------------------------------------------------------

async function startServer (setup: Setup, payload: number): Promise<{ url: string, pid: number, stop: () => Promise<void> }> {
  const child = spawn(process.execPath, ['--import', 'tsx', SERVER], {
    cwd: ROOT,
    env: { ...process.env, SETUP: setup, DATABASE_URL, REDIS_URL, BENCH_SCHEMA: SCHEMA, BENCH_POOL_MAX: String(CONFIG.poolMax), BENCH_PAYLOAD: String(payload) },
    stdio: ['ignore', 'pipe', 'inherit']
  })
  server = child
  const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)))
  const port = await new Promise<number>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`server ${setup} did not listen within 30 s`)), 30_000)
    createInterface({ input: child.stdout! }).on('line', (line) => {
      let port: unknown
      try { port = (JSON.parse(line) as { port?: unknown }).port } catch { return } // not the port line
      if (typeof port === 'number') { clearTimeout(timer); resolve(port) }
    })
    void exited.then((code) => { clearTimeout(timer); reject(new Error(`server ${setup} exited (${code}) before listening`)) })
  })
  return {
    url: `http://127.0.0.1:${port}`,
    pid: child.pid!,
    async stop () {
      child.kill('SIGTERM')
      const timer = setTimeout(() => child.kill('SIGKILL'), 5_000)
      const code = await exited
      clearTimeout(timer)
      server = null
      if (code !== 0) throw new Error(`server ${setup} exited with ${code} on SIGTERM`)
    }
  }
}

function load (url: string, requests: autocannon.Request[], seconds: number, connections: number): Promise<autocannon.Result> {
  return autocannon({
    url,
    connections,
    duration: seconds,
    // The stop is checked at each sample; the default (1 s) would stretch a 1.5 s run to 2 s.
    sampleInt: 100,
    headers: { 'content-type': 'application/json' },
    body: BODY,
    requests
  })
}

interface Stats { executions: number, storeCalls: number | null, latencyUs: Latency }

async function stats (url: string): Promise<Stats> {
  const response = await fetch(`${url}/stats`)
  const body = await response.json() as { executions: number, storeCalls?: number, latencyUs: { samples: number, p50: number | null, p99: number | null, p99_9: number | null } }
  const { samples, p50, p99, p99_9 } = body.latencyUs
  return { executions: body.executions, storeCalls: body.storeCalls ?? null, latencyUs: { samples, p50: p50 ?? NaN, p99: p99 ?? NaN, p99_9: p99_9 ?? NaN } }
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

async function measure (scenario: Scenario, setup: Setup, round: number): Promise<Run> {
  // Every measurement starts from empty tables (and a new process), whatever ran before it.
  await admin`TRUNCATE ${admin(SCHEMA)}.records, ${admin(SCHEMA)}.floor_records, ${admin(SCHEMA)}.payments`
  const instance = await startServer(setup, scenario.payload)
  try {
    const tag = randomBytes(4).toString('hex')
    await scenario.prepare?.(instance.url, tag)
    const requests = scenario.requests(tag)
    const connections = scenario.connections ?? CONFIG.connections
    const initial = await stats(instance.url)
    await load(instance.url, requests, CONFIG.warmupSeconds, connections)
    const before = await stats(instance.url)
    await resetLatency(instance.url)
    const result = await load(instance.url, requests, CONFIG.durationSeconds, connections)
    const after = await stats(instance.url)
    const counts = before.storeCalls !== null && after.storeCalls !== null && COUNTED.has(setup)
    const run: Run = {
      scenario: scenario.name,
      round,
      setup,
      requestsPerSecond: Math.round(result.requests.total / result.duration),
      requests: result.requests.total,
      durationSeconds: result.duration,
      latencyUs: after.latencyUs,
      latencyRatioToBare: null,
      latencyMs: {
        p50: result.latency.p50,
        p90: result.latency.p90,
        p99: result.latency.p99,
        p99_9: result.latency.p99_9,
        mean: result.latency.mean,
        max: result.latency.max
      },
      statusCodes: Object.fromEntries(Object.entries(result.statusCodeStats ?? {}).map(([code, stat]) => [code, stat.count ?? 0])),
      non2xx: result.non2xx,
      errors: result.errors,
      timeouts: result.timeouts,
      executions: after.executions - before.executions,
      executionsWithWarmup: after.executions - initial.executions,
      storeCallsPerRequest: counts ? Math.round((after.storeCalls! - before.storeCalls!) / result.requests.total * 1000) / 1000 : null,
      peakRssMiB: peakRssMiB(instance.pid),
      ratioToBare: null,
      ratioToFloor: null,
      problems: []
    }
    const allowed = new Set(scenario.allowedNon2xx ?? [])
    const unexpected = Object.entries(run.statusCodes).some(([code, count]) => count > 0 && !code.startsWith('2') && !allowed.has(Number(code)))
    if (run.latencyUs.samples < run.requests) run.problems.push(`${run.latencyUs.samples} latency samples for ${run.requests} requests`)
    if (run.errors > 0 || unexpected) run.problems.push(`${run.errors} errors, ${run.non2xx} non-2xx (${JSON.stringify(run.statusCodes)})`)
    run.problems.push(...scenario.check(run))
    return run
  } finally {
    await instance.stop()
  }
}

// --- summary ------------------------------------------------------------------------------------

function median (values: number[]): number {
  const sorted = values.filter(Number.isFinite).sort((a, b) => a - b)
  if (sorted.length === 0) return NaN
  const mid = sorted.length >> 1
  return sorted.length % 2 === 1 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2
}

const ratio = (a: number, b: number): number => Math.round(a / b * 1000) / 1000

/** Ratios within a round: the two runs were measured minutes apart at most, on the same drift. */
function addRatios (runs: Run[]): void {
  for (const run of runs) {
    const peer = (setup: Setup): Run | undefined => runs.find((r) => r.scenario === run.scenario && r.round === run.round && r.setup === setup)
    const bare = peer('bare')
    const floor = peer('floor-sql')
    if (bare !== undefined) {
      run.ratioToBare = ratio(run.requestsPerSecond, bare.requestsPerSecond)
      run.latencyRatioToBare = {
        p50: ratio(run.latencyUs.p50, bare.latencyUs.p50),
        p99: ratio(run.latencyUs.p99, bare.latencyUs.p99),
        p99_9: ratio(run.latencyUs.p99_9, bare.latencyUs.p99_9)
      }
    }
    if (floor !== undefined && PG_SETUPS.has(run.setup)) run.ratioToFloor = ratio(run.requestsPerSecond, floor.requestsPerSecond)
  }
}

interface Summary {
  setup: Setup
  requestsPerSecond: number
  requestsPerSecondByRound: number[]
  ratioToBare: number | null
  ratioToFloor: number | null
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
  /** Median calls reaching the store per request (pg-lease, pg-redis). */
  storeCallsPerRequest: number | null
}

function summarise (runs: Run[], scenario: Scenario): Summary[] {
  return scenario.setups.map((setup) => {
    const mine = runs.filter((run) => run.scenario === scenario.name && run.setup === setup)
    const medianRatio = (pick: (run: Run) => number | null): number | null => {
      const values = mine.map(pick).filter((v): v is number => v !== null)
      return values.length === 0 ? null : median(values)
    }
    return {
      setup,
      requestsPerSecond: median(mine.map((run) => run.requestsPerSecond)),
      requestsPerSecondByRound: mine.map((run) => run.requestsPerSecond),
      ratioToBare: medianRatio((run) => run.ratioToBare),
      ratioToFloor: medianRatio((run) => run.ratioToFloor),
      p50Us: median(mine.map((run) => run.latencyUs.p50)),
      p99Us: median(mine.map((run) => run.latencyUs.p99)),
      p99_9Us: median(mine.map((run) => run.latencyUs.p99_9)),
      p50UsToBare: medianRatio((run) => run.latencyRatioToBare?.p50 ?? null),
      p99UsToBare: medianRatio((run) => run.latencyRatioToBare?.p99 ?? null),
      p99_9UsToBare: medianRatio((run) => run.latencyRatioToBare?.p99_9 ?? null),
      clientP50Ms: median(mine.map((run) => run.latencyMs.p50)),
      clientP99Ms: median(mine.map((run) => run.latencyMs.p99)),
      non2xx: mine.reduce((sum, run) => sum + run.non2xx, 0),
      errors: mine.reduce((sum, run) => sum + run.errors, 0),
      peakRssMiB: Math.max(...mine.map((run) => run.peakRssMiB)),
      storeCallsPerRequest: medianRatio((run) => run.storeCallsPerRequest)
    }
  })
}

function table (scenario: Scenario, rows: Summary[]): string {
  const head = ['setup', 'req/s', '× bare', '× floor-sql', 'p50 µs (× bare)', 'p99 µs (× bare)', 'p99.9 µs (× bare)', 'client p50/p99 ms', 'non-2xx', 'errors', 'store calls/req', 'peak RSS', 'req/s by round']
  const us = (value: number, toBare: number | null): string => `${Number.isFinite(value) ? Math.round(value) : '—'} (${fixed(toBare)})`
  const fixed = (v: number | null, digits = 2): string => v === null ? '—' : v.toFixed(digits)
  const body = rows.map((row) => [
    row.setup,
    Math.round(row.requestsPerSecond).toLocaleString('en-US'),
    fixed(row.ratioToBare),
    fixed(row.ratioToFloor),
    us(row.p50Us, row.p50UsToBare),
    us(row.p99Us, row.p99UsToBare),
    us(row.p99_9Us, row.p99_9UsToBare),
    `${row.clientP50Ms}/${row.clientP99Ms}`,
    String(row.non2xx),
    String(row.errors),
    fixed(row.storeCallsPerRequest, 3),
    `${row.peakRssMiB} MiB`,
    row.requestsPerSecondByRound.map((v) => v.toLocaleString('en-US')).join(' ')
  ])
  const widths = head.map((h, i) => Math.max(h.length, ...body.map((cells) => cells[i]!.length)))
  const line = (cells: string[]): string => `| ${cells.map((c, i) => i === 0 || i === cells.length - 1 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!)).join(' | ')} |`
  return [
    `${scenario.name}: ${scenario.description}`,
    line(head),
    `|${widths.map((w, i) => i === 0 || i === widths.length - 1 ? `:${'-'.repeat(w + 1)}` : `${'-'.repeat(w + 1)}:`).join('|')}|`,
    ...body.map(line)
  ].join('\n')
}

// --- the chart -----------------------------------------------------------------------------------

const COLOURS: Record<Setup, string> = {
  bare: '#9e9e9e',
  memory: '#1f77b4',
  'peer-memory': '#aec7e8',
  'pg-lease': '#2ca02c',
  'pg-atomic': '#98df8a',
  'pg-redis': '#d62728',
  'peer-redis': '#ff9896',
  'floor-sql': '#7f7f7f'
}

const escapeXml = (text: string): string => text.replace(/[<>&"]/g, (c) => ({ '<': '&lt;', '>': '&gt;', '&': '&amp;', '"': '&quot;' })[c]!)

/**
 * Grouped bars, hand-built SVG: one group per scenario, one bar per setup (bare is the dashed line
 * at 1.0), the bar's height its median req/s ratio to bare, the ratio printed above it.
 */
function chart (summaries: Array<{ scenario: Scenario, rows: Summary[] }>, text: { title: string, subtitle: string, subtitle2: string, subtitle3: string }): string {
  const width = 1100
  const height = 560
  const margin = { top: 110, right: 170, bottom: 70, left: 70 }
  const plotW = width - margin.left - margin.right
  const plotH = height - margin.top - margin.bottom
  const groups = summaries.map(({ scenario, rows }) => ({ scenario, rows: rows.filter((row) => row.setup !== 'bare' && row.ratioToBare !== null) }))
  const maxRatio = Math.max(1, ...groups.flatMap(({ rows }) => rows.map((row) => row.ratioToBare!)))
  const top = Math.ceil(maxRatio * 5 + 0.5) / 5 // room for the labels above the tallest bar
  const y = (v: number): number => margin.top + plotH - v / top * plotH
  const groupW = plotW / groups.length
  const maxBars = Math.max(...groups.map(({ rows }) => rows.length))
  const barW = Math.min(28, groupW * 0.84 / maxBars)
  const out: string[] = []
  out.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" font-family="Helvetica, Arial, sans-serif">`)
  out.push(`<rect width="${width}" height="${height}" fill="#ffffff"/>`)
  out.push(`<text x="${margin.left}" y="26" font-size="17" font-weight="bold" fill="#222">${escapeXml(text.title)}</text>`)
  out.push(`<text x="${margin.left}" y="48" font-size="12" fill="#444">${escapeXml(text.subtitle)}</text>`)
  out.push(`<text x="${margin.left}" y="66" font-size="12" fill="#444">${escapeXml(text.subtitle2)}</text>`)
  out.push(`<text x="${margin.left}" y="84" font-size="12" fill="#444">${escapeXml(text.subtitle3)}</text>`)
  // Grid and y axis.
  for (let v = 0; v <= top + 1e-9; v += 0.2) {
    const yy = y(v).toFixed(1)
    out.push(`<line x1="${margin.left}" x2="${margin.left + plotW}" y1="${yy}" y2="${yy}" stroke="#e4e4e4"/>`)
    out.push(`<text x="${margin.left - 8}" y="${yy}" font-size="11" fill="#444" text-anchor="end" dominant-baseline="middle">${v.toFixed(1)}</text>`)
  }
  out.push(`<line x1="${margin.left}" x2="${margin.left}" y1="${margin.top}" y2="${margin.top + plotH}" stroke="#444"/>`)
  out.push(`<line x1="${margin.left}" x2="${margin.left + plotW}" y1="${margin.top + plotH}" y2="${margin.top + plotH}" stroke="#444"/>`)
  out.push(`<text transform="translate(20 ${margin.top + plotH / 2}) rotate(-90)" font-size="13" fill="#222" text-anchor="middle">req/s ÷ bare's req/s (same round)</text>`)
  // bare = 1.0, under the bars and their labels.
  out.push(`<line x1="${margin.left}" x2="${margin.left + plotW}" y1="${y(1).toFixed(1)}" y2="${y(1).toFixed(1)}" stroke="#555" stroke-dasharray="6 4"/>`)
  out.push(`<text x="${margin.left + plotW + 6}" y="${y(1).toFixed(1)}" font-size="11" fill="#555" dominant-baseline="middle">bare = 1.0</text>`)
  // Bars.
  groups.forEach(({ scenario, rows }, g) => {
    const x0 = margin.left + g * groupW + (groupW - rows.length * barW) / 2
    rows.forEach((row, i) => {
      const v = row.ratioToBare!
      const x = x0 + i * barW
      out.push(`<rect x="${(x + 1).toFixed(1)}" y="${y(v).toFixed(1)}" width="${(barW - 2).toFixed(1)}" height="${(y(0) - y(v)).toFixed(1)}" fill="${COLOURS[row.setup]}"><title>${escapeXml(`${scenario.name} ${row.setup}: ${v.toFixed(2)}× bare, ${Math.round(row.requestsPerSecond)} req/s`)}</title></rect>`)
      const lx = (x + barW / 2).toFixed(1)
      const ly = (y(v) - 4).toFixed(1)
      out.push(`<text transform="translate(${lx} ${ly}) rotate(-90)" font-size="10" fill="#222" dominant-baseline="middle">${v.toFixed(2)}</text>`)
    })
    const cx = margin.left + (g + 0.5) * groupW
    out.push(`<text x="${cx.toFixed(1)}" y="${margin.top + plotH + 20}" font-size="13" fill="#222" text-anchor="middle">${escapeXml(scenario.name)}</text>`)
    out.push(`<text x="${cx.toFixed(1)}" y="${margin.top + plotH + 36}" font-size="10" fill="#666" text-anchor="middle">${escapeXml(scenario.payload >= 1024 ? `${Math.round(scenario.payload / 1024)} KiB body` : `~${scenario.payload} B body`)}${scenario.connections !== undefined ? `, ${scenario.connections} conn.` : ''}</text>`)
  })
  out.push(`<text x="${margin.left + plotW / 2}" y="${height - 12}" font-size="13" fill="#222" text-anchor="middle">scenario</text>`)
  // Legend.
  const shown = SETUPS.filter((setup) => setup !== 'bare' && groups.some(({ rows }) => rows.some((row) => row.setup === setup)))
  const lx = margin.left + plotW + 20
  out.push(`<text x="${lx}" y="${margin.top + 10}" font-size="12" font-weight="bold" fill="#222">setup</text>`)
  shown.forEach((setup, i) => {
    const ly = margin.top + 26 + i * 22
    out.push(`<rect x="${lx}" y="${ly}" width="14" height="14" fill="${COLOURS[setup]}"/>`)
    out.push(`<text x="${lx + 20}" y="${ly + 7}" font-size="12" fill="#222" dominant-baseline="middle">${escapeXml(setup)}${setup.startsWith('peer-') ? ' (peer)' : ''}</text>`)
  })
  out.push('</svg>')
  return `${out.join('\n')}\n`
}

function packageVersion (name: string): string {
  return (JSON.parse(readFileSync(path.join(ROOT, 'node_modules', name, 'package.json'), 'utf8')) as { version: string }).version
}

// --- main ---------------------------------------------------------------------------------------

const startedAt = new Date()
const log = (message: string): void => { process.stderr.write(`[bench] ${message}\n`) }
try {
  await createSchema()
  const database = await describeDatabase()
  log(`PostgreSQL ${database.server_version} (fsync=${database.fsync}, synchronous_commit=${database.synchronous_commit}), ` +
    `${CONFIG.rounds} round(s) × ${CONFIG.durationSeconds} s, ${CONFIG.connections} connections`)

  const runs: Run[] = []
  for (const scenario of SCENARIOS) {
    for (let round = 1; round <= CONFIG.rounds; round++) {
      for (const setup of scenario.setups) {
        const run = await measure(scenario, setup, round)
        runs.push(run)
        log(`${scenario.name} round ${round} ${setup}: ${run.requestsPerSecond.toLocaleString('en-US')} req/s${run.problems.length > 0 ? `  PROBLEM: ${run.problems.join('; ')}` : ''}`)
      }
    }
  }
  addRatios(runs)

  const summaries = SCENARIOS.map((scenario) => ({ scenario, rows: summarise(runs, scenario) }))
  const notes = [
    `Medians over ${CONFIG.rounds} round(s); each ratio is taken within a round, then its median reported.`,
    'Latency in µs is the server\'s own (process.hrtime.bigint() from an onRequest hook added before any plugin to an onResponse hook, log-linear histogram under 1% error, reset after the warm-up), with its ratio to bare\'s in the same round; "client ms" is autocannon\'s, whole milliseconds, and includes queueing in the load generator.',
    `The peer is @node-idempotency/core ${packageVersion('@node-idempotency/core')} with its memory and Redis (node-redis ${packageVersion('redis')}) storage adapters, wired into Fastify by benchmarks/peer-glue.ts (its Fastify adapter is not on the registry): a preHandler calling onRequest() and an onSend calling onResponse(). The glue records only handler responses (the unpublished adapter also re-records replays and its own 409s), which favours the peer.`,
    'Same-backend pairs: memory vs peer-memory (both in-process maps), and pg-redis vs peer-redis, the closest pair but not the same backend: peer-redis keeps everything in Redis (SET NX, then SET), where pg-redis keeps the records in PostgreSQL behind a Redis pre-filter. The peer\'s PostgreSQL adapter is not on the registry, so pg-lease and pg-atomic have no same-backend peer.',
    `Payloads: the response body is ~${SMALL} bytes, or ${LARGE / 1024} KiB (the payment plus a padding field) in the -64k scenarios, which run only ${LARGE_SETUPS.join(', ')} to bound the run.`,
    `Durability: fsync=${database.fsync}, synchronous_commit=${database.synchronous_commit}, full_page_writes=${database.full_page_writes}` +
      (services !== null ? ' (the throwaway server of scripts/services.mjs: commits are not durable, so absolute figures are above a production server\'s; floor-sql runs under the same settings).' : ' (the server of DATABASE_URL).'),
    'pg-atomic also inserts one business row per fresh key, in the transaction that holds the claim; no other setup writes one.',
    'floor-sql answers a replay with two statements (the claim finds the key, then a SELECT); the plugin\'s claim reads the record in the same statement, so the replay ratio to floor-sql is not a floor ratio.',
    'Load generator, servers and PostgreSQL share the machine\'s cores: expect about ±15% between runs.'
  ]
  const output = [
    ...summaries.map(({ scenario, rows }) => table(scenario, rows)),
    notes.map((note) => `- ${note}`).join('\n')
  ].join('\n\n')
  process.stdout.write(`${output}\n`)

  const cpus = os.cpus()
  const result = {
    benchmark: 'postgres',
    date: startedAt.toISOString(),
    quick: QUICK,
    elapsedSeconds: Math.round((Date.now() - startedAt.getTime()) / 1000),
    machine: {
      cpuModel: cpus[0]?.model ?? 'unknown',
      cores: cpus.length,
      memoryGiB: Math.round(os.totalmem() / 2 ** 30 * 10) / 10,
      platform: `${os.platform()} ${os.release()}`,
      loadAverageAtStart
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
    database: { provisioned: services !== null ? 'throwaway (scripts/services.mjs)' : 'DATABASE_URL', settings: database },
    config: CONFIG,
    notes,
    scenarios: Object.fromEntries(summaries.map(({ scenario, rows }) => [scenario.name, { description: scenario.description, setups: rows }])),
    runs
  }
  mkdirSync(path.dirname(OUT), { recursive: true })
  writeFileSync(OUT, `${JSON.stringify(result, null, 2)}\n`)
  writeFileSync(CHART, chart(summaries, {
    title: `Throughput relative to bare (req/s ÷ bare's, same round; median of ${CONFIG.rounds} round(s)${QUICK ? ', quick mode' : ''})`,
    subtitle: `${result.machine.cores}-core ${result.machine.cpuModel.replace(/\s+/g, ' ').trim()}, ${startedAt.toISOString().slice(0, 10)}; ` +
      `Node ${process.version.slice(1)}, Fastify ${result.versions.fastify}, PostgreSQL ${database.server_version}`,
    subtitle2: `PostgreSQL durability: fsync=${database.fsync}, synchronous_commit=${database.synchronous_commit}, full_page_writes=${database.full_page_writes}` +
      `${services !== null ? ' (throwaway server: commits not durable)' : ''}`,
    subtitle3: `peer: @node-idempotency/core ${result.versions.peerCore} (benchmarks/peer-glue.ts); ${CONFIG.connections} connections (storm ${STORM.connections}), ` +
      `${CONFIG.durationSeconds} s per run, all processes on this one machine`
  }))
  log(`wrote ${path.relative(process.cwd(), OUT)} and ${path.relative(process.cwd(), CHART)} in ${result.elapsedSeconds} s`)

  const problems = runs.filter((run) => run.problems.length > 0)
  if (problems.length > 0) {
    log(`${problems.length} run(s) had problems: ${problems.map((run) => `${run.scenario}/${run.setup}/${run.round}: ${run.problems.join('; ')}`).join(' | ')}`)
    process.exitCode = 1
  }
} finally {
  await admin`DROP SCHEMA IF EXISTS ${admin(SCHEMA)} CASCADE`.catch(() => {})
  await admin.end({ timeout: 2 })
  await services?.stop()
}
