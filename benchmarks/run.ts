/**
 * `npm run bench [-- --quick] [--out summary.json] [--only scenario,…] [--setups setup,…] [--rounds n] [--unpinned]`:
 * the plugin against bare Fastify, hand-written SQL (the floors) and the peer library, each setup
 * serving the same route from a server process of its own (server.ts), loaded by autocannon from
 * this process (pinning.ts). In a round, a new server per setup is warmed up, then the setups take
 * the measured load in turns of 1-second slices, in a rotating order, so that the machine's slow
 * spells fall on every setup alike (ratios: figures.ts); a sequential probe then counts one
 * request's statements, round trips and Redis commands (counting.ts). Prints a table per scenario
 * and every target (targets.ts); writes the `load` section of benchmarks/results/summary.json and
 * redraws docs/benchmarks-chart.svg from it. --quick (the test suite's): one short slice each, one
 * server per setup and body size. A quick run or a subset writes summary.quick.json and
 * chart.quick.svg instead; --out: that file, and chart.svg beside it.
 */
import type { ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { readFileSync, writeFileSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { parseArgs } from 'node:util'
import autocannon from 'autocannon'
import postgres from 'postgres'
import { chart, DOCS_CHART } from './chart.js'
import { summarise, table, type Latency, type PerRequest, type Run } from './figures.js'
import { pinning } from './pinning.js'
import { BODY } from './route.js'
import { scenarios, SETUPS, type Scenario, type Setup } from './scenarios.js'
import { createBenchSchema, describeDatabase, truncateBenchSchema } from './schema.js'
import { startBenchServer } from './server-process.js'
import { benchServices } from './services.js'
import { readSummary, summaryPath, writeSection, type LoadSection } from './summary-file.js'
import { targetsReport } from './targets.js'

const { values: args } = parseArgs({
  options: {
    quick: { type: 'boolean', default: false },
    out: { type: 'string' },
    only: { type: 'string' },
    setups: { type: 'string' },
    rounds: { type: 'string', default: '5' },
    unpinned: { type: 'boolean', default: false }
  }
})
const QUICK = args.quick === true
/** Only a complete full run replaces the published figures. */
const PARTIAL = QUICK || args.only !== undefined || args.setups !== undefined
const OUT = summaryPath(args.out, PARTIAL)
const CHART = args.out !== undefined ? path.join(path.dirname(OUT), 'chart.svg') : PARTIAL ? path.join(path.dirname(OUT), 'chart.quick.svg') : DOCS_CHART
const ROUNDS = Number(args.rounds)
if (!Number.isInteger(ROUNDS) || ROUNDS < 1) throw new Error(`--rounds must be a whole number >= 1, received ${args.rounds}`)
const POOL_MAX = 10
const PROBE = { warmup: QUICK ? 3 : 10, requests: QUICK ? 10 : 40 }

const list = (value: string | undefined): Set<string> | null => value === undefined ? null : new Set(value.split(',').map((s) => s.trim()).filter(Boolean))
const onlyScenarios = list(args.only)
const onlySetups = list(args.setups)
const ALL = scenarios(QUICK, ROUNDS)
for (const name of onlyScenarios ?? []) if (!ALL.some((s) => s.name === name)) throw new Error(`--only: no scenario ${name}; one of ${ALL.map((s) => s.name).join(', ')}`)
for (const name of onlySetups ?? []) if (!(SETUPS as readonly string[]).includes(name)) throw new Error(`--setups: no setup ${name}; one of ${SETUPS.join(', ')}`)
const SCENARIOS = ALL
  .filter((s) => onlyScenarios?.has(s.name) ?? true)
  .map((s) => ({ ...s, setups: s.setups.filter((setup) => onlySetups?.has(setup) ?? true) }))
  .filter((s) => s.setups.length > 0)

const servers = new Set<ChildProcess>()
const services = await benchServices(() => { for (const child of servers) child.kill('SIGKILL') })
const PIN = pinning(!QUICK && args.unpinned !== true)
const SCHEMA = `bench_${randomBytes(4).toString('hex')}`
const admin = postgres(services.databaseUrl, { max: 2, onnotice: () => {} })

interface Instance { setup: Setup, url: string, stop: () => Promise<void> }

async function startServer (setup: Setup, payload: number): Promise<Instance> {
  const env = { SETUP: setup, DATABASE_URL: services.databaseUrl, REDIS_URL: services.redisUrl, BENCH_SCHEMA: SCHEMA, BENCH_POOL_MAX: String(POOL_MAX), BENCH_PAYLOAD: String(payload) }
  return { setup, ...await startBenchServer(PIN, env, servers) }
}

async function post (url: string, key: string): Promise<number> {
  const response = await fetch(`${url}/pay`, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: BODY })
  await response.arrayBuffer()
  return response.status
}

interface Wire { statements: number, roundTrips: number }
interface Stats { executions: number, requests: number, pg: Wire | null, redis: Wire | null, latencyUs: Latency, cpuUs: number }

async function stats (url: string): Promise<Stats> {
  return await (await fetch(`${url}/stats`)).json() as Stats
}

/** /stats once the requests a load left in flight have finished: two polls 25 ms apart that agree, or 2 s. */
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

/**
 * What reached PostgreSQL and Redis between two /stats, and the server's CPU time, per request
 * answered in between.
 */
function perRequest (before: Stats, after: Stats): PerRequest {
  const requests = after.requests - before.requests
  const per = (a: Wire | null, b: Wire | null, key: keyof Wire): number | null =>
    a === null || b === null || requests === 0 ? null : Math.round((b[key] - a[key]) / requests * 1000) / 1000
  return {
    pgStatements: per(before.pg, after.pg, 'statements'),
    pgRoundTrips: per(before.pg, after.pg, 'roundTrips'),
    redisCommands: per(before.redis, after.redis, 'statements'),
    redisRoundTrips: per(before.redis, after.redis, 'roundTrips'),
    serverCpuUs: requests === 0 ? null : Math.round((after.cpuUs - before.cpuUs) / requests)
  }
}

/** A load of `seconds`, or of exactly `amount` requests, each with the next key. */
function load (url: string, nextKey: () => string, seconds: number, connections: number, amount?: number): Promise<autocannon.Result> {
  return autocannon({
    url,
    connections,
    duration: seconds,
    ...(amount === undefined ? {} : { amount }),
    sampleInt: 100, // the stop is checked at each sample: the default (1 s) would stretch a slice
    headers: { 'content-type': 'application/json' },
    body: BODY,
    requests: [{ method: 'POST', path: '/pay', setupRequest: (request) => { (request.headers ??= {})['idempotency-key'] = nextKey(); return request } }]
  })
}

/** One setup's measurement in progress: warmed up, then loaded slice by slice. */
interface Measuring { scenario: Scenario, instance: Instance, tag: string, nextKey: () => string, amount?: number, initial: Stats, before: Stats, slices: autocannon.Result[] }

async function warmUp (scenario: Scenario, instance: Instance): Promise<Measuring> {
  const tag = randomBytes(4).toString('hex')
  await scenario.prepare?.((key) => post(instance.url, key), tag)
  const nextKey = scenario.keys(tag)
  const initial = await stats(instance.url)
  const warmup = await load(instance.url, nextKey, scenario.timing.warmupSeconds, scenario.connections)
  // Quick mode loads a number of requests, what the warm-up's rate fits in the slice and at least 3
  // per connection: a 0.2 s load by time alone can end with nothing answered on a busy machine.
  const amount = QUICK ? Math.max(Math.round(warmup.requests.total / Math.max(warmup.duration, 0.001) * scenario.timing.sliceSeconds), 3 * scenario.connections) : undefined
  const before = await settled(instance.url)
  await (await fetch(`${instance.url}/stats/reset`, { method: 'POST' })).arrayBuffer()
  return { scenario, instance, tag, nextKey, amount, initial, before, slices: [] }
}

async function loadSlice (m: Measuring): Promise<void> {
  m.slices.push(await load(m.instance.url, m.nextKey, m.scenario.timing.sliceSeconds, m.scenario.connections, m.amount))
}

/** The slices as one Run, then the sequential probe and the scenario's checks. */
async function finish (m: Measuring, round: number): Promise<Run> {
  const { scenario, instance } = m
  const after = await stats(instance.url)
  const requests = m.slices.reduce((sum, r) => sum + r.requests.total, 0)
  const duration = m.slices.reduce((sum, r) => sum + r.duration, 0)
  const problems: string[] = []
  const statuses: Record<string, number> = {}
  for (const slice of m.slices) for (const [code, stat] of Object.entries(slice.statusCodeStats ?? {})) statuses[code] = (statuses[code] ?? 0) + (stat.count ?? 0)
  const errors = m.slices.reduce((sum, r) => sum + r.errors, 0)
  const wrong = Object.entries(statuses).some(([code, count]) => count > 0 && !code.startsWith('2') && !(code === '409' && scenario.conflicts === true))
  if (errors > 0 || wrong) problems.push(`${errors} errors, statuses ${JSON.stringify(statuses)}`)
  if (after.latencyUs.samples < requests) problems.push(`${after.latencyUs.samples} latency samples for ${requests} requests`)
  let counts = perRequest(m.before, after)
  // CPU time under the load; the sequential probe below counts statements exactly, not CPU.
  const { serverCpuUs } = counts
  let probed: number | null = null
  // The probe: requests one at a time, for the exact counts of the setups with a backend.
  if (scenario.probeKey !== undefined && (after.pg !== null || after.redis !== null)) {
    await settled(instance.url)
    const send = async (i: number): Promise<void> => {
      const status = await post(instance.url, scenario.probeKey!(i, m.tag))
      if (status < 200 || status >= 300) problems.push(`the probe's request ${i} answered ${status}`)
    }
    for (let i = 0; i < PROBE.warmup; i++) await send(i)
    const start = await settled(instance.url) // a response goes out before the Redis copy after it
    for (let i = PROBE.warmup; i < PROBE.warmup + PROBE.requests; i++) await send(i)
    counts = { ...perRequest(start, await settled(instance.url)), serverCpuUs }
    probed = counts.pgStatements
  }
  problems.push(...scenario.check({
    setup: instance.setup,
    requests,
    slices: m.slices.length,
    executions: after.executions - m.before.executions,
    executionsWithWarmup: after.executions - m.initial.executions,
    pgStatements: probed
  }))
  return {
    scenario: scenario.name,
    setup: instance.setup,
    round,
    sliceRates: m.slices.map((r) => Math.round(r.requests.total / r.duration)),
    requestsPerSecond: Math.round(requests / duration),
    latencyUs: after.latencyUs,
    perRequest: counts,
    problems
  }
}

/** One round of a scenario: a new server per setup, the setups taking turns slice by slice. */
async function measureRound (scenario: Scenario, round: number, record: (run: Run) => void): Promise<void> {
  await truncateBenchSchema(admin, SCHEMA)
  const instances: Instance[] = []
  try {
    for (const setup of scenario.setups) instances.push(await startServer(setup, scenario.payload))
    const measuring: Measuring[] = []
    for (const instance of instances) measuring.push(await warmUp(scenario, instance))
    for (let slice = 0; slice < scenario.timing.slices; slice++) {
      for (let turn = 0; turn < measuring.length; turn++) await loadSlice(measuring[(slice + turn) % measuring.length]!)
    }
    for (const m of measuring) record(await finish(m, round))
  } finally {
    const stopped = await Promise.allSettled(instances.map((instance) => instance.stop()))
    const refused = stopped.find((result): result is PromiseRejectedResult => result.status === 'rejected')
    // A server that would not stop would skew the next setup's figures: reported even over a failure.
    if (refused !== undefined) throw refused.reason // eslint-disable-line no-unsafe-finally
  }
}

async function measureAll (record: (run: Run) => void): Promise<void> {
  if (!QUICK) {
    for (const scenario of SCENARIOS) for (let round = 1; round <= scenario.timing.rounds; round++) await measureRound(scenario, round, record)
    return
  }
  const groups = new Map<string, { setup: Setup, payload: number, scenarios: Scenario[] }>()
  for (const scenario of SCENARIOS) {
    for (const setup of scenario.setups) {
      const id = `${setup}/${scenario.payload}`
      if (!groups.has(id)) groups.set(id, { setup, payload: scenario.payload, scenarios: [] })
      groups.get(id)!.scenarios.push(scenario)
    }
  }
  for (const { setup, payload, scenarios } of groups.values()) {
    const instance = await startServer(setup, payload)
    try {
      for (const scenario of scenarios) {
        await truncateBenchSchema(admin, SCHEMA)
        const m = await warmUp(scenario, instance)
        await loadSlice(m)
        record(await finish(m, 1))
      }
    } finally {
      await instance.stop()
    }
  }
}

const version = (name: string): string => (JSON.parse(readFileSync(new URL(`../node_modules/${name}/package.json`, import.meta.url), 'utf8')) as { version: string }).version
const log = (message: string): void => { process.stderr.write(`[bench] ${message}\n`) }

try {
  await createBenchSchema(admin, SCHEMA)
  const database = await describeDatabase(admin)
  log(`PostgreSQL ${database.server_version}; ${PIN.description}${QUICK ? '; quick' : ''}`)
  const runs: Run[] = []
  await measureAll((run) => {
    runs.push(run)
    log(`${run.scenario} round ${run.round} ${run.setup}: ${run.requestsPerSecond.toLocaleString('en-US')} req/s${run.problems.length > 0 ? `  PROBLEM: ${run.problems.join('; ')}` : ''}`)
  })
  const section: LoadSection = {
    environment: {
      cpu: os.cpus()[0]?.model.replace(/\s+/g, ' ').trim() ?? 'unknown',
      cores: os.cpus().length,
      node: process.version,
      fastify: version('fastify'),
      postgres: database.server_version?.split(' ')[0] ?? 'unknown',
      postgresClient: version('postgres'),
      peer: version('@node-idempotency/core'),
      pinned: PIN.pinned,
      durability: `fsync=${database.fsync}, synchronous_commit=${database.synchronous_commit}, full_page_writes=${database.full_page_writes}${services.provisioned ? ' (throwaway server: commits not durable)' : ''}`
    },
    scenarios: Object.fromEntries(SCENARIOS.map((s) => [s.name, {
      description: s.description,
      payload: s.payload,
      connections: s.connections,
      rounds: s.timing.rounds,
      slices: s.timing.slices,
      floors: s.floors as Record<string, string>,
      setups: summarise(runs.filter((run) => run.scenario === s.name), s.setups)
    }]))
  }
  for (const [name, s] of Object.entries(section.scenarios)) process.stdout.write(`${table(`${name}: ${s.description}`, s.setups, s.floors)}\n\n`)
  writeSection(OUT, 'load', section)
  writeFileSync(CHART, chart(section))
  process.stdout.write(`${targetsReport(readSummary(OUT))}\n`)
  log(`wrote ${path.relative(process.cwd(), OUT)} and ${path.relative(process.cwd(), CHART)}`)
  const failed = runs.filter((run) => run.problems.length > 0)
  if (failed.length > 0) {
    log(`${failed.length} measurement(s) had problems: ${failed.map((run) => `${run.scenario}/${run.setup}/${run.round}: ${run.problems.join('; ')}`).join(' | ')}`)
    process.exitCode = 1
  }
} finally {
  await admin`DROP SCHEMA IF EXISTS ${admin(SCHEMA)} CASCADE`.catch(() => {})
  await admin.end({ timeout: 2 })
  PIN.restore()
  await services.stop()
}
