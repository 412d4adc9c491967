import { spawn } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import t from 'tap'
import { chart } from '../../benchmarks/chart.js'
import { scenarios } from '../../benchmarks/scenarios.js'
import { readSummary, SUMMARY, writeSection, type Summary } from '../../benchmarks/summary-file.js'
import { evaluateTargets, TARGETS } from '../../benchmarks/targets.js'

/**
 * The benchmark scripts run in quick mode and write their sections of a summary file; the committed
 * summary is complete, small, and the chart is drawn from it. No figure is judged here (performance
 * belongs to the benchmarks, run on a quiet machine); a run fails only on a wrong answer (an error,
 * an execution too many, a floor's statement count off: the counting itself would be wrong).
 * Uses the suite's DATABASE_URL/REDIS_URL.
 */

const root = fileURLToPath(new URL('../..', import.meta.url))
// The quick runs' fixed load durations and server starts, more when another test file shares the cores.
t.setTimeout(300_000)

function run (script: string, extra: string[]): Promise<{ code: number | null, output: string }> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, ['--expose-gc', '--import', 'tsx', script, '--quick', ...extra], { cwd: root })
    let output = ''
    child.stdout.on('data', (chunk: Buffer) => { output += chunk.toString() })
    child.stderr.on('data', (chunk: Buffer) => { output += chunk.toString() })
    child.on('error', reject)
    child.on('close', (code) => resolve({ code, output }))
  })
}

const dir = mkdtempSync(join(tmpdir(), 'idem-bench-'))
t.teardown(() => rmSync(dir, { recursive: true, force: true }))
const out = join(dir, 'summary.json')
const SCENARIOS = scenarios(false, 5)

t.test('the committed summary holds every section, under 100 KB, and the published chart is drawn from it', async (t) => {
  t.ok(statSync(SUMMARY).size < 100 * 1024, `${statSync(SUMMARY).size} bytes`)
  const summary = readSummary(SUMMARY)
  t.same(Object.keys(summary).sort(), ['claimForms', 'fingerprint', 'load', 'memory', 'reference', 'storm'])
  t.same(Object.keys(summary.load!.scenarios), SCENARIOS.map((s) => s.name), 'every scenario of npm run bench')
  for (const scenario of SCENARIOS) t.same(Object.keys(summary.load!.scenarios[scenario.name]!.setups), scenario.setups, `${scenario.name}: every setup`)
  t.ok(evaluateTargets(summary).every((target) => target.met !== null), 'every target has its figure')
  t.equal(readFileSync(join(root, 'docs', 'benchmarks-chart.svg'), 'utf8'), chart(summary.load!), 'docs/benchmarks-chart.svg is chart() of the summary (npm run bench:chart redraws it)')
})

t.test('a script replaces its own section of the summary and keeps the others', async (t) => {
  const file = join(dir, 'sections.json')
  writeFileSync(file, JSON.stringify({ fingerprint: { node: 'v0', rounds: 1, bodies: [] }, reference: { records: 1 } }))
  writeSection(file, 'fingerprint', { node: 'v1', rounds: 2, bodies: [] })
  t.same(readSummary(file), { fingerprint: { node: 'v1', rounds: 2, bodies: [] }, reference: { records: 1 } } as unknown as Summary)
})

t.test('npm run bench -- --quick writes the load section, the chart from it, and prints every target', async (t) => {
  if (process.env.DATABASE_URL === undefined || process.env.REDIS_URL === undefined) return t.fail('DATABASE_URL and REDIS_URL must be set (npm test sets them)')
  const { code, output } = await run('benchmarks/run.ts', ['--out', out])
  t.equal(code, 0, 'exit 0', { output: output.slice(-3000) })
  const load = readSummary(out).load!
  t.same(Object.keys(load.scenarios), SCENARIOS.map((s) => s.name))
  for (const scenario of SCENARIOS) {
    const setups = load.scenarios[scenario.name]!.setups
    t.same(Object.keys(setups), scenario.setups, `${scenario.name}: every setup measured`)
    for (const [setup, f] of Object.entries(setups)) {
      t.ok(f.requestsPerSecond > 0 && f.p99Us > 0, `${scenario.name} ${setup}: req/s and latency`)
      if (setup !== 'bare') t.ok(f.ratioTo.bare! > 0, `${scenario.name} ${setup}: its ratio to bare`)
      if (setup.startsWith('pg-') || setup.startsWith('floor-')) t.type(f.pgStatements, 'number', `${scenario.name} ${setup}: statements counted`)
      if (setup.includes('redis')) t.ok(f.redisCommands! > 0, `${scenario.name} ${setup}: Redis commands counted`)
    }
  }
  // The floors run a known number of statements: the counting itself is checked.
  const figures = (scenario: string, setup: string) => load.scenarios[scenario]!.setups[setup]!
  t.equal(figures('fresh', 'floor-sql').pgStatements, 2, 'floor-sql: 2 statements per fresh key')
  t.equal(figures('fresh', 'floor-txn').pgStatements, 5, 'floor-txn: 5 statements per fresh key')
  t.equal(figures('fresh', 'floor-txn').pgRoundTrips, 5, 'floor-txn: 5 round trips per fresh key')
  t.equal(figures('replay', 'floor-select').pgStatements, 1, 'floor-select: 1 statement per replay')
  t.equal(figures('replay', 'memory').pgStatements, null, 'nothing counted where there is no database')
  t.match(output, new RegExp(`^targets: \\d+ of \\d+ measured met \\(${TARGETS.length} in all\\)$`, 'm'))
  for (const target of TARGETS) t.ok(output.includes(`- ${target.text}: `), `printed: ${target.text}`)
  t.equal(readFileSync(join(dir, 'chart.svg'), 'utf8'), chart(load), 'the chart is drawn from the section written')
})

t.test('npm run bench:memory -- --quick writes the memory section', async (t) => {
  const { code, output } = await run('benchmarks/memory.ts', ['--out', out])
  t.equal(code, 0, 'exit 0', { output: output.slice(-2000) })
  const { fill } = readSummary(out).memory!
  t.equal(fill.records, 50_000)
  t.equal(fill.extrapolated, true)
  t.ok(fill.rssMiB > 0 && fill.arrayBuffersMiB > 0 && fill.rssMBFor1M > 0, 'filled and measured')
  // The records live off the JS heap, in array buffers: 50,000 records of 200-byte bodies take at least 10 MB of them.
  t.ok(fill.arrayBuffersMiB * 2 ** 20 >= 50_000 * 200, `${fill.arrayBuffersMiB} MiB of array buffers`)
})

t.test('npm run bench:reference -- --quick writes the reference section', async (t) => {
  if (process.env.DATABASE_URL === undefined) return t.fail('DATABASE_URL must be set (npm test sets it)')
  const { code, output } = await run('benchmarks/reference.ts', ['--out', out])
  t.equal(code, 0, 'exit 0', { output: output.slice(-2000) })
  const reference = readSummary(out).reference!
  t.equal(reference.records, 300)
  t.ok(reference.ref.bodyBytesPerRecord < reference.full.bodyBytesPerRecord, 'a reference is smaller than the body it stands for')
  t.ok(reference.full.freshPerSecond > 0 && reference.ref.replayPerSecond > 0, 'both loads served')
})

t.test('npm run bench:claim-forms -- --quick compares the claim forms and checks every answer', async (t) => {
  if (process.env.DATABASE_URL === undefined) return t.fail('DATABASE_URL must be set (npm test sets it)')
  // The script throws (exit ≠ 0) on any claim whose outcome is wrong for its path.
  const { code, output } = await run('benchmarks/postgres-claim-forms.ts', ['--out', out])
  t.equal(code, 0, 'exit 0', { output: output.slice(-2000) })
  const result = readSummary(out).claimForms!
  t.same(Object.keys(result.paths.fresh), ['cte', 'upsert', 'read-first'])
  t.same(Object.keys(result.paths.duplicate), ['cte', 'upsert', 'read-first', 'select'])
  t.equal(result.paths.duplicate.cte!.toCte, 1)
  // The upsert writes a row version per duplicate. (WAL is the whole server's, which other test
  // files share: only a lower bound can be asserted here.)
  t.ok(result.walBytesPerDuplicate.upsert! > 100, `upsert: ${result.walBytesPerDuplicate.upsert} WAL bytes per duplicate`)
})

t.test('npm run bench:storm -- --quick: one run for a storm of waiting duplicates, each replayed, and what a waiter cost', async (t) => {
  if (process.env.DATABASE_URL === undefined) return t.fail('DATABASE_URL must be set (npm test sets it)')
  // The script throws (exit ≠ 0) when the handler ran more than once or a duplicate was not answered 2xx.
  const { code, output } = await run('benchmarks/storm.ts', ['--out', out])
  t.equal(code, 0, 'exit 0', { output: output.slice(-2000) })
  const storm = readSummary(out).storm!
  t.same(storm.results.map((result) => result.mode), ['lease', 'atomic'])
  for (const result of storm.results) {
    t.equal(result.handlerRuns, 1, `${result.mode}: the handler ran once`)
    t.same(result.statuses, { 200: 30 }, `${result.mode}: 30 duplicates, each answered`)
    t.ok(result.commitToAnswer.p99 >= 0, `${result.mode}: every waiter answered after the original committed (p99 ${result.commitToAnswer.p99} ms)`)
  }
  // At most a claim when a waiter comes and one once it is woken (lease mode), or a claim in a
  // transaction (BEGIN, the claim, ROLLBACK) and one read (atomic mode); the duplicates of one
  // instance share theirs (lib/core/shared-calls.ts), so a storm costs less than one each.
  const [lease, atomic] = storm.results
  t.ok(lease !== undefined && lease.statementsPerWaiter > 0 && lease.statementsPerWaiter <= 2, `lease mode: ${lease?.statementsPerWaiter} statements per waiter, at most 2`)
  t.ok(atomic !== undefined && atomic.statementsPerWaiter > 0 && atomic.statementsPerWaiter <= 4, `atomic mode: ${atomic?.statementsPerWaiter} statements per waiter, at most 4`)
})
