/**
 * The two load generators side by side, in the same window: `npm run bench:generators [-- --quick]
 * [--rounds n] [--out file]` (Linux: it reads /proc; needs wrk, as bench:crosscheck does).
 *
 * Why (issue 14, docs/benchmarks.md "The second harness"): `npm run bench` (autocannon) and
 * `npm run bench:crosscheck` (wrk) run one after the other, 26 and 13 minutes apart, so a ratio
 * they disagree on could be the machine changing between them or the generators measuring
 * differently. Here both drive the same two servers (benchmarks/server.ts: `bare` and `memory`,
 * fresh keys, 200 B, 10 connections), pinned as run.ts pins, in 1-second slices taken in a rotating
 * order of the four (setup, generator) cells, so a slow spell of the machine falls on all of them
 * alike. For each slice: req/s, the server's CPU per request and how busy it was (the share of
 * the slice's wall time it spent on CPU, /proc), and autocannon's own CPU per request (it runs in
 * this process). A server below full use while the generator had work to give is bound by its
 * generator, and its rate then measures the generator as much as the server.
 *
 * Each ratio is the median over the slice quads (one slice of each cell) of memory ÷ bare, in req/s
 * and per CPU of the server, per generator. Writes benchmarks/results/generators.json
 * (generators.quick.json with --quick). No PostgreSQL or Redis.
 */
import { spawn, spawnSync } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { writeFileSync } from 'node:fs'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import { autocannonLoad, keyed } from './autocannon-load.js'
import { measuredCpuMs, processCpuMs } from './measured-cpu.js'
import { cpuMsSince, pinning } from './pinning.js'
import { median } from './ratios.js'
import { BODY } from './route.js'
import { startBenchServer, type BenchServer } from './server-process.js'

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const LUA = path.join(ROOT, 'benchmarks', 'crosscheck.lua')
const { values: args } = parseArgs({ options: { quick: { type: 'boolean', default: false }, rounds: { type: 'string' }, out: { type: 'string' } } })
const QUICK = args.quick === true
const ROUNDS = QUICK ? 1 : Number(args.rounds ?? 5)
if (!Number.isInteger(ROUNDS) || ROUNDS < 1) throw new Error(`--rounds must be a whole number >= 1, received ${args.rounds}`)
const OUT = args.out ?? path.join(ROOT, 'benchmarks', 'results', QUICK ? 'generators.quick.json' : 'generators.json')
const SLICES = QUICK ? 1 : 4
const SLICE_SECONDS = 1
const WARMUP_SECONDS = QUICK ? 1 : 2
const CONNECTIONS = 10
/** wrk's threads, as the crosscheck's. */
const WRK_THREADS = 2
/** A server busier than this share of a slice is taken as saturated (its own CPU bounds it). */
const SATURATED = 0.9

const WRK = process.env.WRK ?? 'wrk'
if (process.platform !== 'linux') {
  process.stderr.write('bench:generators reads /proc/<pid>/stat: Linux only\n')
  process.exit(2)
}
if (spawnSync(WRK, ['--version']).error !== undefined) {
  process.stderr.write(`[generators] wrk is not installed (${WRK}): install it with \`apt-get install -y wrk\`\n`)
  process.exit(2)
}

const SETUPS = ['bare', 'memory'] as const
const GENERATORS = ['autocannon', 'wrk'] as const
type Setup = typeof SETUPS[number]
type Generator = typeof GENERATORS[number]
type Cell = `${Setup} ${Generator}`

interface Slice {
  readonly reqPerSec: number
  readonly serverCpuUsPerRequest: number
  /** The part of serverCpuUsPerRequest the kernel spent on the server's behalf (its socket reads and writes). */
  readonly serverSystemUsPerRequest: number
  readonly serverBusy: number
  readonly generatorCpuUsPerRequest: number | null
}

const PIN = pinning(QUICK ? 'off' : 'auto')
const log = (message: string): void => { process.stderr.write(`[generators] ${message}\n`) }

let autocannonKeys = 0
let wrkRuns = 0
/** One load of `seconds`: the requests answered (every one must be a 201) and, for autocannon, its CPU. */
async function drive (generator: Generator, url: string, seconds: number): Promise<{ requests: number, generatorCpuMs: number | null }> {
  if (generator === 'autocannon') {
    const since = process.cpuUsage()
    // As run.ts's fresh scenario: a new key per request.
    const result = await autocannonLoad(url, keyed(() => `"g-${autocannonKeys++}"`), seconds, CONNECTIONS)
    if (result.non2xx > 0 || result.errors > 0) throw new Error(`autocannon: ${result.non2xx} non-2xx, ${result.errors} errors`)
    return { requests: result.requests.total, generatorCpuMs: cpuMsSince(since) }
  }
  const [command, argv] = PIN.generator(WRK, ['-t', String(WRK_THREADS), '-c', String(CONNECTIONS), '-d', `${seconds}s`, '--timeout', '10s', '-s', LUA, `${url}/pay`])
  const output = await new Promise<string>((resolve, reject) => {
    const child = spawn(command, argv, {
      env: { ...process.env, CROSSCHECK_MODE: 'fresh', CROSSCHECK_TAG: randomBytes(4).toString('hex'), CROSSCHECK_RUN: String(wrkRuns++), CROSSCHECK_BODY: BODY },
      stdio: ['ignore', 'pipe', 'inherit']
    })
    let text = ''
    child.stdout.on('data', (chunk: Buffer) => { text += chunk.toString() })
    child.once('exit', (code) => { if (code === 0) resolve(text); else reject(new Error(`wrk exited with ${code}: ${text}`)) })
  })
  const line = /^CROSSCHECK (\{.*\})$/m.exec(output)?.[1]
  if (line === undefined) throw new Error(`wrk printed no summary: ${output}`)
  const summary = JSON.parse(line) as { requests: number, status: number, connect: number, read: number, write: number, timeout: number }
  const errors = summary.status + summary.connect + summary.read + summary.write + summary.timeout
  if (errors > 0) throw new Error(`wrk: ${errors} errors or non-2xx answers`)
  return { requests: summary.requests, generatorCpuMs: null }
}

async function slice (generator: Generator, server: BenchServer): Promise<Slice> {
  const cpuBefore = measuredCpuMs(server.pid)!
  const systemBefore = processCpuMs(server.pid)!.system
  const started = process.hrtime.bigint()
  const { requests, generatorCpuMs } = await drive(generator, server.url, SLICE_SECONDS)
  const wallMs = Number(process.hrtime.bigint() - started) / 1e6
  const cpuMs = measuredCpuMs(server.pid)! - cpuBefore
  const systemMs = processCpuMs(server.pid)!.system - systemBefore
  return {
    reqPerSec: requests / SLICE_SECONDS,
    serverCpuUsPerRequest: cpuMs * 1000 / requests,
    serverSystemUsPerRequest: systemMs * 1000 / requests,
    serverBusy: cpuMs / wallMs,
    generatorCpuUsPerRequest: generatorCpuMs === null ? null : generatorCpuMs * 1000 / requests
  }
}

const CELLS: Array<{ setup: Setup, generator: Generator, cell: Cell }> = SETUPS.flatMap((setup) => GENERATORS.map((generator) => ({ setup, generator, cell: `${setup} ${generator}` as Cell })))
const quads: Array<Record<Cell, Slice>> = []
for (let round = 1; round <= ROUNDS; round++) {
  const servers = {} as Record<Setup, BenchServer>
  try {
    for (const setup of SETUPS) servers[setup] = await startBenchServer({ pin: PIN, env: { SETUP: setup, BENCH_PAYLOAD: '200' }, label: setup })
    for (const { setup, generator } of CELLS) await drive(generator, servers[setup].url, WARMUP_SECONDS)
    for (let n = 0; n < SLICES; n++) {
      const quad = {} as Record<Cell, Slice>
      for (let i = 0; i < CELLS.length; i++) {
        const { setup, generator, cell } = CELLS[(i + n + round) % CELLS.length]!
        quad[cell] = await slice(generator, servers[setup])
      }
      quads.push(quad)
      log(`round ${round} slice ${n + 1}: ` + CELLS.map(({ cell }) => `${cell} ${Math.round(quad[cell].reqPerSec)}/s ${quad[cell].serverCpuUsPerRequest.toFixed(1)} µs ${Math.round(quad[cell].serverBusy * 100)}%`).join(' | '))
    }
  } finally {
    await Promise.allSettled(Object.values(servers).map((server) => server.stop()))
  }
}

const round3 = (value: number): number => Math.round(value * 1000) / 1000
const of = (cell: Cell, figure: (s: Slice) => number | null): number | null => {
  const values = quads.map((quad) => figure(quad[cell])).filter((value): value is number => value !== null)
  return values.length === 0 ? null : round3(median(values))
}
const byGenerator = Object.fromEntries(GENERATORS.map((generator) => {
  const bare: Cell = `bare ${generator}`
  const memory: Cell = `memory ${generator}`
  const ratio = (quad: Record<Cell, Slice>): number => quad[memory].reqPerSec / quad[bare].reqPerSec
  const saturated = quads.filter((quad) => quad[bare].serverBusy >= SATURATED)
  const generatorBound = quads.filter((quad) => quad[bare].serverBusy < SATURATED)
  return [generator, {
    memoryOverBare: round3(median(quads.map(ratio))),
    memoryOverBarePerCpu: round3(median(quads.map((quad) => quad[bare].serverCpuUsPerRequest / quad[memory].serverCpuUsPerRequest))),
    bare: { reqPerSec: Math.round(of(bare, (s) => s.reqPerSec)!), serverCpuUsPerRequest: of(bare, (s) => s.serverCpuUsPerRequest), serverSystemUsPerRequest: of(bare, (s) => s.serverSystemUsPerRequest), serverBusy: of(bare, (s) => s.serverBusy), generatorCpuUsPerRequest: of(bare, (s) => s.generatorCpuUsPerRequest) },
    memory: { reqPerSec: Math.round(of(memory, (s) => s.reqPerSec)!), serverCpuUsPerRequest: of(memory, (s) => s.serverCpuUsPerRequest), serverSystemUsPerRequest: of(memory, (s) => s.serverSystemUsPerRequest), serverBusy: of(memory, (s) => s.serverBusy), generatorCpuUsPerRequest: of(memory, (s) => s.generatorCpuUsPerRequest) },
    // The mechanism: the ratio where this generator kept bare's server saturated, and where it did not.
    bareSaturated: { quads: saturated.length, memoryOverBare: saturated.length === 0 ? null : round3(median(saturated.map(ratio))) },
    bareGeneratorBound: { quads: generatorBound.length, memoryOverBare: generatorBound.length === 0 ? null : round3(median(generatorBound.map(ratio))) }
  }]
}))
const wrkOverAutocannon = Object.fromEntries(SETUPS.map((setup) => [setup, {
  reqPerSec: round3(median(quads.map((quad) => quad[`${setup} wrk`].reqPerSec / quad[`${setup} autocannon`].reqPerSec))),
  serverCpuUsPerRequest: round3(median(quads.map((quad) => quad[`${setup} wrk`].serverCpuUsPerRequest / quad[`${setup} autocannon`].serverCpuUsPerRequest))),
  serverSystemUsPerRequest: round3(median(quads.map((quad) => quad[`${setup} wrk`].serverSystemUsPerRequest / quad[`${setup} autocannon`].serverSystemUsPerRequest)))
}]))

writeFileSync(OUT, JSON.stringify({
  benchmark: 'generators',
  date: new Date().toISOString(),
  quick: QUICK,
  node: process.version,
  wrk: spawnSync(WRK, ['--version'], { encoding: 'utf8' }).stdout.split('\n')[0]?.trim() ?? 'wrk',
  pinning: PIN.description,
  config: { rounds: ROUNDS, slicesPerRound: SLICES, sliceSeconds: SLICE_SECONDS, warmupSeconds: WARMUP_SECONDS, connections: CONNECTIONS, wrkThreads: WRK_THREADS, saturatedBusyShare: SATURATED, payloadBytes: 200 },
  byGenerator,
  wrkOverAutocannon,
  quads
}, null, 2) + '\n')
for (const generator of GENERATORS) {
  const g = byGenerator[generator]!
  log(`${generator}: memory ÷ bare ${g.memoryOverBare} (per CPU ${g.memoryOverBarePerCpu}); bare ${g.bare.reqPerSec} req/s, server ${Math.round((g.bare.serverBusy ?? 0) * 100)}% busy; ` +
    `bare saturated in ${g.bareSaturated.quads} of ${quads.length} quads (ratio ${g.bareSaturated.memoryOverBare ?? '-'}), generator-bound in ${g.bareGeneratorBound.quads} (ratio ${g.bareGeneratorBound.memoryOverBare ?? '-'})`)
}
log(`wrk ÷ autocannon, same slices: bare ${wrkOverAutocannon.bare!.reqPerSec} req/s, ${wrkOverAutocannon.bare!.serverCpuUsPerRequest} server CPU per request (${wrkOverAutocannon.bare!.serverSystemUsPerRequest} of its system part); memory ${wrkOverAutocannon.memory!.reqPerSec}, ${wrkOverAutocannon.memory!.serverCpuUsPerRequest} (${wrkOverAutocannon.memory!.serverSystemUsPerRequest})`)
for (const setup of SETUPS) {
  log(`${setup}: server CPU per request (system part), autocannon ${byGenerator.autocannon![setup].serverCpuUsPerRequest} µs (${byGenerator.autocannon![setup].serverSystemUsPerRequest}), wrk ${byGenerator.wrk![setup].serverCpuUsPerRequest} µs (${byGenerator.wrk![setup].serverSystemUsPerRequest})`)
}
log(`wrote ${path.relative(ROOT, OUT)}`)
