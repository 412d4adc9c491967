import { spawn, spawnSync } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync, existsSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import t from 'tap'

/**
 * The benchmark scripts start and produce a well-formed result in quick mode. No figure is judged
 * here (performance claims live in the benchmarks, run on a quiet machine); a run fails only when
 * it finds a wrong answer (an error, an execution too many, a floor's statement count off: the
 * counting itself would be wrong). Uses the suite's DATABASE_URL/REDIS_URL.
 */

const root = fileURLToPath(new URL('..', import.meta.url))
// About 110 s on its own (most of it the quick runs' fixed load durations and server starts), more
// when another test file shares the two cores: room beyond the suite's 120 s per file.
t.setTimeout(300_000)

function run (script: string, extra: string[], env: NodeJS.ProcessEnv = process.env): Promise<{ code: number | null, output: string }> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, ['--expose-gc', '--import', 'tsx', script, '--quick', ...extra], { cwd: root, env })
    let output = ''
    child.stdout.on('data', (chunk: Buffer) => { output += chunk.toString() })
    child.stderr.on('data', (chunk: Buffer) => { output += chunk.toString() })
    child.on('error', reject)
    child.on('close', (code) => resolve({ code, output }))
  })
}

const SCENARIOS = ['fresh', 'fresh-1m', 'fresh-64k', 'fresh-c1', 'fresh-c100', 'replay', 'replay-1m', 'replay-64k', 'replay-c1', 'replay-c100', 'storm']
const POSTGRES = new Set(['pg-lease', 'pg-atomic', 'pg-redis', 'pg-redis-unpipelined', 'floor-sql', 'floor-select', 'floor-txn'])

interface Row {
  setup: string
  requestsPerSecond: number
  errors: number
  ratioToBare: number | null
  ratioTo: Record<string, number>
  p99Us: number
  pgStatements: number | null
  probePgStatements: number | null
  probePgRoundTrips: number | null
  redisCommands: number | null
}

const dir = mkdtempSync(join(tmpdir(), 'idem-bench-'))
t.teardown(() => rmSync(dir, { recursive: true, force: true }))
const benchOut = join(dir, 'result.json')

t.test('npm run bench -- --quick writes a well-formed result, its targets and a chart', async (t) => {
  if (process.env.DATABASE_URL === undefined || process.env.REDIS_URL === undefined) return t.fail('DATABASE_URL and REDIS_URL must be set (npm test sets them)')
  const { code, output } = await run('benchmarks/run.ts', ['--out', benchOut])
  t.equal(code, 0, output.slice(-3000))
  const result = JSON.parse(readFileSync(benchOut, 'utf8')) as {
    scenarios: Record<string, { setups: Row[] }>
    ratios: Array<{ name: string, ratio: number | null, cpuRatio: number | null }>
    targets: Array<{ id: string, met: boolean | null, measured: string }>
  }
  t.same(Object.keys(result.scenarios).sort(), SCENARIOS)
  for (const [name, scenario] of Object.entries(result.scenarios)) {
    t.ok(scenario.setups.some((row) => row.setup === 'bare'), `${name} has its baseline`)
    for (const row of scenario.setups) {
      const what = `${name} ${row.setup}`
      t.ok(typeof row.requestsPerSecond === 'number' && row.requestsPerSecond > 0, `${what}: req/s`)
      t.equal(row.errors, 0, `${what}: no errors`)
      t.type(row.ratioToBare, 'number', `${what}: ratio to bare`)
      t.type(row.p99Us, 'number', `${what}: p99`)
      if (POSTGRES.has(row.setup)) t.type(row.pgStatements, 'number', `${what}: statements counted`)
      if (POSTGRES.has(row.setup) && name !== 'storm') t.type(row.probePgRoundTrips, 'number', `${what}: round trips probed`)
      if (row.setup === 'pg-redis' || row.setup === 'pg-redis-unpipelined' || row.setup === 'peer-redis') t.type(row.redisCommands, 'number', `${what}: Redis commands counted`)
    }
  }
  // The floors run a known number of statements: the counting itself is checked.
  const floor = (scenario: string, setup: string): Row | undefined => result.scenarios[scenario]?.setups.find((row) => row.setup === setup)
  t.equal(floor('fresh', 'floor-sql')?.probePgStatements, 2, 'floor-sql: 2 statements per fresh key')
  t.equal(floor('fresh', 'floor-txn')?.probePgStatements, 5, 'floor-txn: 5 statements per fresh key')
  t.equal(floor('fresh', 'floor-txn')?.probePgRoundTrips, 5, 'floor-txn: 5 round trips per fresh key')
  t.equal(floor('replay', 'floor-select')?.probePgStatements, 1, 'floor-select: 1 statement per replay')
  t.type(floor('fresh', 'pg-atomic')?.ratioTo['floor-txn'], 'number', 'pg-atomic has its ratio to floor-txn')
  t.equal(result.ratios.length, 19, 'the ratios the crosscheck reproduces')
  t.ok(result.ratios.every((r) => typeof r.ratio === 'number'), 'every ratio measured')
  t.ok(result.ratios.every((r) => typeof r.cpuRatio === 'number' && r.cpuRatio > 0), 'every ratio measured per CPU of the measured side too')
  t.equal(result.targets.length, 18, 'every target of issue 14')
  t.ok(result.targets.every((target) => typeof target.met === 'boolean'), 'every target judged, met or missed')
  t.match(output, /^targets: \d+ of 18 measured met/m, 'the targets section is printed')
  t.ok(existsSync(join(dir, 'chart.quick.svg')), 'the chart was written')
  t.match(readFileSync(join(dir, 'chart.quick.svg'), 'utf8'), /^<svg /)
})

t.test('npm run bench:memory -- --quick writes a well-formed result', async (t) => {
  const out = join(dir, 'memory.json')
  const { code, output } = await run('benchmarks/memory.ts', ['--out', out])
  t.equal(code, 0, output.slice(-2000))
  type Capacity = { method: string, records: number, rssMiB: number, heapUsedMiB: number, bytesPerRecord: { rss: number, heapUsed: number, arrayBuffers: number }, rssFor1MMB: number }
  const result = JSON.parse(readFileSync(out, 'utf8')) as {
    capacity: { plugin: Capacity, store: Capacity, target: { maxRssMB: number, met: boolean } }
    steady: Array<{ mode: string, rssMiB: number[] }>
  }
  for (const method of ['plugin', 'store'] as const) {
    const c = result.capacity[method]
    t.equal(c.method, method)
    t.ok(c.records > 0 && c.rssMiB > 0 && c.heapUsedMiB > 0, `${method}: filled and measured`)
    // Completed records live off the JS heap (drivers/memory-table.ts), so the heap's share of a
    // record is a few bytes either way of zero (Node 22 once measured it below 0); its array buffers are not.
    t.ok(c.bytesPerRecord.heapUsed + c.bytesPerRecord.arrayBuffers > 0 && c.rssFor1MMB > 0, `${method}: per record, and for 1M`)
  }
  t.equal(result.capacity.target.maxRssMB, 500)
  t.type(result.capacity.target.met, 'boolean')
  t.same(result.steady.map((run) => run.mode), ['replay', 'fresh-short-ttl'])
  t.ok(result.steady.every((run) => run.rssMiB.length >= 4), 'RSS was sampled through each run')
})

t.test('npm run bench:reference -- --quick writes a well-formed result', async (t) => {
  if (process.env.DATABASE_URL === undefined) return t.fail('DATABASE_URL must be set (npm test sets it)')
  const out = join(dir, 'reference.json')
  const { code, output } = await run('benchmarks/reference.ts', ['--out', out])
  t.equal(code, 0, output.slice(-2000))
  const result = JSON.parse(readFileSync(out, 'utf8')) as {
    records: number
    storage: Record<'full' | 'ref', { records: number, tableBytes: number, bodyBytesPerRecord: number }>
    freshRatio: number
    replayRatio: number
  }
  t.equal(result.storage.full.records, result.records, 'every fresh key recorded once (full)')
  t.equal(result.storage.ref.records, result.records, 'every fresh key recorded once (by reference)')
  t.ok(result.storage.ref.bodyBytesPerRecord < result.storage.full.bodyBytesPerRecord, 'a reference is smaller than the body it stands for')
  t.type(result.freshRatio, 'number')
  t.type(result.replayRatio, 'number')
})

t.test('npm run bench:claim-forms -- --quick compares the claim forms and checks every answer', async (t) => {
  if (process.env.DATABASE_URL === undefined) return t.fail('DATABASE_URL must be set (npm test sets it)')
  const out = join(dir, 'claim-forms.json')
  // The script throws (exit ≠ 0) on any claim whose outcome is wrong for its path.
  const { code, output } = await run('benchmarks/postgres-claim-forms.ts', ['--out', out])
  t.equal(code, 0, output.slice(-2000))
  const result = JSON.parse(readFileSync(out, 'utf8')) as {
    paths: Record<'fresh' | 'duplicate', Record<string, { claimsPerSecond: number, toCte: number }>>
    walBytesPerDuplicate: Record<string, number>
  }
  t.same(Object.keys(result.paths.fresh), ['cte', 'upsert', 'read-first'])
  t.same(Object.keys(result.paths.duplicate), ['cte', 'upsert', 'read-first', 'select'])
  t.equal(result.paths.duplicate.cte!.toCte, 1)
  // The upsert writes a row version per duplicate. (WAL is the whole server's, which other test
  // files share: only a lower bound can be asserted here.)
  t.ok(result.walBytesPerDuplicate.upsert! > 100, `upsert: ${result.walBytesPerDuplicate.upsert} WAL bytes per duplicate`)
})

t.test('npm run bench:page-faults -- --quick measures req/s and page faults per request of each setup', async (t) => {
  const out = join(dir, 'page-faults.json')
  const { code, output } = await run('benchmarks/page-faults.ts', ['--out', out])
  t.equal(code, 0, output.slice(-2000))
  const result = JSON.parse(readFileSync(out, 'utf8')) as {
    summary: Record<string, { reqPerSec: number, ratioToBare: number, faultsPerRequest: number }>
    measurements: Array<{ setup: string, statusCodes: Record<string, number> }>
    problems: string[]
  }
  t.same(Object.keys(result.summary), ['bare', 'memory', 'memory-expiring'])
  t.same(result.problems, [])
  t.ok(result.measurements.every((m) => Object.keys(m.statusCodes).join() === '201'), 'every answer a 201')
  t.ok(Object.values(result.summary).every((s) => s.reqPerSec > 0), 'each setup served')
  // Not a timing: a store that keeps 64 KiB per request cannot grow without mapping new pages
  // (16 per request); fewer would mean the script does not read the server's own counter.
  t.ok(result.summary.memory!.faultsPerRequest >= 8, `the growing store: ${result.summary.memory!.faultsPerRequest} page faults per request`)
})

t.test('npm run bench:generators -- --quick drives bare and memory with both generators in the same slices', { skip: spawnSync('wrk', ['--version']).error === undefined ? false : 'wrk is not installed (.ci/run installs it)' }, async (t) => {
  const out = join(dir, 'generators.json')
  const { code, output } = await run('benchmarks/generators.ts', ['--out', out])
  t.equal(code, 0, output.slice(-2000))
  const result = JSON.parse(readFileSync(out, 'utf8')) as {
    byGenerator: Record<string, { memoryOverBare: number, memoryOverBarePerCpu: number, bare: { reqPerSec: number, serverBusy: number, generatorCpuUsPerRequest: number | null }, bareSaturated: { quads: number }, bareGeneratorBound: { quads: number } }>
    quads: Array<Record<string, { reqPerSec: number, serverCpuUsPerRequest: number, serverSystemUsPerRequest: number, serverBusy: number }>>
  }
  t.same(Object.keys(result.byGenerator), ['autocannon', 'wrk'])
  t.equal(result.quads.length, 1, 'one slice of each cell')
  t.same(Object.keys(result.quads[0]!).sort(), ['bare autocannon', 'bare wrk', 'memory autocannon', 'memory wrk'])
  for (const [generator, g] of Object.entries(result.byGenerator)) {
    t.ok(g.memoryOverBare > 0 && g.memoryOverBarePerCpu > 0, `${generator}: both ratios measured`)
    t.equal(g.bareSaturated.quads + g.bareGeneratorBound.quads, 1, `${generator}: the quad is counted as saturated or generator-bound`)
  }
  t.ok(result.byGenerator.autocannon!.bare.generatorCpuUsPerRequest! > 0, 'autocannon\'s own CPU is measured (it runs in the script)')
  // The kernel's part of the server's CPU: measured, and a part (the 10 ms ticks of /proc can round either to 0).
  t.ok(Object.values(result.quads[0]!).every((slice) => slice.serverSystemUsPerRequest >= 0 && slice.serverSystemUsPerRequest <= slice.serverCpuUsPerRequest), 'system time per request measured, within the whole')
})

t.test('npm run bench:crosscheck says how to install wrk when it is missing', async (t) => {
  const { code, output } = await run('benchmarks/crosscheck.ts', [], { ...process.env, WRK: join(dir, 'no-such-wrk') })
  t.equal(code, 2, output)
  t.match(output, /wrk is not installed/)
  t.match(output, /apt-get install -y wrk/)
})

const hasWrk = spawnSync('wrk', ['--version']).error === undefined
t.test('npm run bench:crosscheck -- --quick --same-window reproduces the ratios and compares them with autocannon in the same slices and with run.ts', { skip: hasWrk ? false : 'wrk is not installed (the missing-wrk message is tested above)' }, async (t) => {
  if (process.env.DATABASE_URL === undefined || process.env.REDIS_URL === undefined) return t.fail('DATABASE_URL and REDIS_URL must be set (npm test sets them)')
  const out = join(dir, 'crosscheck.json')
  const against = existsSync(benchOut) ? ['--against', benchOut] : []
  const { code, output } = await run('benchmarks/crosscheck.ts', ['--same-window', '--out', out, ...against])
  if (!existsSync(out)) return t.fail(`no result written (exit ${code ?? 'null'})`, { output: output.slice(-3000) })
  const result = JSON.parse(readFileSync(out, 'utf8')) as {
    ratios: Array<{ name: string, ratio: number | null, cpuRatio: number | null }>
    comparison: Array<{ name: string, crosscheck: number | null, runTs: number | null, flagged: boolean, cpuCrosscheck: number | null, cpuRunTs: number | null }>
    autocannonRatios: Array<{ name: string, ratio: number | null, cpuRatio: number | null }> | null
    sameWindow: Array<{ name: string, wrk: number | null, autocannon: number | null, difference: number | null, flagged: boolean }> | null
    measurements: Array<{ round: number, scenario: string, setup: string, problems: string[], failed: boolean, requests: number, autocannon: { requests: number, sliceRates: number[], statusCodes: Record<string, number> } | null }>
  }
  // Each failing measurement's problems by name (socket errors, error statuses, executions that do
  // not match the keys sent), so a failure says which load went wrong.
  const problems = result.measurements
    .filter((m) => m.failed)
    .map((m) => `round ${m.round} ${m.scenario} ${m.setup}: ${m.problems.join('; ')}`)
  t.same(problems, [], 'no measurement had a problem')
  t.equal(code, 0, 'exit 0', { output: output.slice(-3000) })
  t.equal(result.ratios.length, 19)
  t.ok(result.ratios.every((r) => typeof r.ratio === 'number'), 'every ratio measured')
  t.ok(result.ratios.every((r) => typeof r.cpuRatio === 'number' && r.cpuRatio > 0), 'every ratio measured per CPU of the measured side too')
  t.equal(result.comparison.length, 19)
  if (against.length > 0) {
    t.ok(result.comparison.every((c) => typeof c.runTs === 'number'), 'compared with the run.ts result of the first test')
    t.ok(result.comparison.every((c) => typeof c.cpuRunTs === 'number'), 'per CPU too')
  }
  t.match(output, /^comparison with run\.ts/m)
  // --same-window: each measurement also loaded by autocannon, and every ratio compared with its.
  t.ok(result.measurements.every((m) => m.requests > 0 && m.autocannon !== null && m.autocannon.requests > 0 && m.autocannon.sliceRates.length === 1), 'each measurement loaded by both generators')
  t.ok(result.measurements.filter((m) => m.scenario !== 'storm').every((m) => Object.keys(m.autocannon?.statusCodes ?? {}).every((code) => code.startsWith('2'))), "autocannon's fresh keys and replays answered 2xx")
  t.same(result.autocannonRatios?.map((r) => r.name), result.ratios.map((r) => r.name), "autocannon's ratios: the same 19")
  t.ok(result.autocannonRatios?.every((r) => typeof r.ratio === 'number' && typeof r.cpuRatio === 'number'), 'every one measured')
  t.ok(result.sameWindow?.every((c, i) => c.wrk === result.ratios[i]!.ratio && c.autocannon === result.autocannonRatios![i]!.ratio && typeof c.difference === 'number'), 'compared ratio by ratio')
  t.match(output, /^comparison with autocannon in the same slices: of req\/s, \d+ of 19 ratios agree/m)
})
