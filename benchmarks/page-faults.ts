/**
 * Where the memory store's fresh-key cost at 64 KiB goes: `npm run bench:page-faults [-- --quick]
 * [--rounds n] [--out file]` (Linux: it reads /proc).
 *
 * Three setups of benchmarks/server.ts answer fresh keys with the 64 KiB payment of `npm run
 * bench`'s 64 KiB scenario: bare Fastify; the memory store keeping every response, as that scenario
 * does (`memory`); and the same store whose records expire after 500 ms and are swept every 200 ms
 * (`memory-expiring`, BENCH_TTL), whose memory is reused once it holds half a second of responses
 * instead of growing. Each round starts a new server per setup, in turn; each is warmed up, then
 * measured. For each: req/s, and the server's minor page faults per request
 * (/proc/<pid>/stat): pages the kernel had to map (and zero) for the process.
 *
 * A store that keeps 64 KiB per request grows by 16 pages per request, and the kernel maps each
 * page when the process first writes to it: whichever code touches the new memory first (the
 * socket write's copy of the response, in the profiles) pays for it. docs/benchmarks.md ("The cost
 * curve") has the figures. Pinned as run.ts pins (benchmarks/pinning.ts), except with --quick.
 * Writes benchmarks/results/page-faults.json (page-faults.quick.json with --quick).
 */
import { readFileSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import autocannon from 'autocannon'
import { pinning } from './pinning.js'
import { median } from './ratios.js'
import { BODY } from './route.js'
import { startBenchServer } from './server-process.js'

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const { values: args } = parseArgs({ options: { quick: { type: 'boolean', default: false }, rounds: { type: 'string' }, out: { type: 'string' } } })
const QUICK = args.quick === true
const ROUNDS = QUICK ? 1 : Number(args.rounds ?? 3)
if (!Number.isInteger(ROUNDS) || ROUNDS < 1) throw new Error(`--rounds must be a whole number >= 1, received ${args.rounds}`)
const OUT = args.out ?? path.join(ROOT, 'benchmarks', 'results', QUICK ? 'page-faults.quick.json' : 'page-faults.json')
const PAYLOAD = 64 * 1024
const CONNECTIONS = 10
const WARMUP_SECONDS = QUICK ? 1 : 3
const SECONDS = QUICK ? 2 : 6
const TTL_MS = 500

if (process.platform !== 'linux') {
  process.stderr.write('bench:page-faults reads /proc/<pid>/stat: Linux only\n')
  process.exit(2)
}

const SETUPS = [
  { name: 'bare', env: { SETUP: 'bare' } },
  { name: 'memory', env: { SETUP: 'memory' } },
  { name: 'memory-expiring', env: { SETUP: 'memory', BENCH_TTL: String(TTL_MS) } }
] as const
type SetupName = typeof SETUPS[number]['name']

interface Measurement { setup: SetupName, round: number, requests: number, reqPerSec: number, faultsPerRequest: number, statusCodes: Record<string, number> }

const PIN = pinning(QUICK ? 'off' : 'auto')
const log = (message: string): void => { process.stderr.write(`[page-faults] ${message}\n`) }

/** The process's minor page faults so far: field 10 of /proc/<pid>/stat (proc(5)), after the command name. */
function minorFaults (pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8')
  return Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[7])
}

let counter = 0
function load (url: string, seconds: number): Promise<autocannon.Result> {
  return autocannon({
    url,
    connections: CONNECTIONS,
    duration: seconds,
    requests: [{
      method: 'POST',
      path: '/pay',
      headers: { 'content-type': 'application/json' },
      body: BODY,
      setupRequest (request) {
        (request.headers ??= {})['idempotency-key'] = `"pf-${counter++}"`
        return request
      }
    }]
  })
}

async function measure (setup: typeof SETUPS[number], round: number): Promise<Measurement> {
  const server = await startBenchServer({ pin: PIN, env: { ...setup.env, BENCH_PAYLOAD: String(PAYLOAD) }, label: setup.name })
  try {
    await load(server.url, WARMUP_SECONDS)
    const before = minorFaults(server.pid)
    const result = await load(server.url, SECONDS)
    const faults = minorFaults(server.pid) - before
    const statusCodes = Object.fromEntries(Object.entries(result.statusCodeStats ?? {}).map(([code, stats]) => [code, (stats as { count: number }).count]))
    return { setup: setup.name, round, requests: result.requests.total, reqPerSec: result.requests.total / SECONDS, faultsPerRequest: faults / result.requests.total, statusCodes }
  } finally {
    await server.stop()
  }
}

// No PostgreSQL or Redis here: only the server processes are placed (PIN.measured).
const measurements: Measurement[] = []
const problems: string[] = []
for (let round = 1; round <= ROUNDS; round++) {
  for (const setup of SETUPS) {
    const m = await measure(setup, round)
    measurements.push(m)
    log(`round ${round} ${m.setup}: ${Math.round(m.reqPerSec)} req/s, ${m.faultsPerRequest.toFixed(2)} minor page faults per request ${JSON.stringify(m.statusCodes)}`)
    const other = Object.keys(m.statusCodes).filter((code) => code !== '201')
    if (other.length > 0 || m.requests === 0) problems.push(`${m.setup} in round ${round} answered ${JSON.stringify(m.statusCodes)}`)
  }
}

const ofRound = (setup: SetupName, round: number): Measurement => measurements.find((m) => m.setup === setup && m.round === round)!
const rounds = Array.from({ length: ROUNDS }, (_, i) => i + 1)
const summary = Object.fromEntries(SETUPS.map(({ name }) => [name, {
  reqPerSec: Math.round(median(rounds.map((round) => ofRound(name, round).reqPerSec))),
  ratioToBare: Number(median(rounds.map((round) => ofRound(name, round).reqPerSec / ofRound('bare', round).reqPerSec)).toFixed(2)),
  faultsPerRequest: Number(median(rounds.map((round) => ofRound(name, round).faultsPerRequest)).toFixed(2))
}]))
writeFileSync(OUT, JSON.stringify({
  benchmark: 'page-faults',
  date: new Date().toISOString(),
  quick: QUICK,
  node: process.version,
  pinning: PIN.description,
  config: { payloadBytes: PAYLOAD, connections: CONNECTIONS, warmupSeconds: WARMUP_SECONDS, seconds: SECONDS, rounds: ROUNDS, expiringTtlMs: TTL_MS },
  summary,
  measurements,
  problems
}, null, 2) + '\n')
for (const [name, s] of Object.entries(summary)) log(`${name}: ${s.reqPerSec} req/s (${s.ratioToBare}× bare), ${s.faultsPerRequest} minor page faults per request (medians over ${ROUNDS} round(s))`)
log(`wrote ${path.relative(ROOT, OUT)}`)
if (problems.length > 0) {
  log(`problems: ${problems.join('; ')}`)
  process.exitCode = 1
}
