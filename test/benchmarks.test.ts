import { spawn } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync, existsSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import t from 'tap'

/**
 * The benchmark scripts start and produce a well-formed result in quick mode. No figure is judged
 * here (performance claims live in the benchmarks, run on a quiet machine); a run fails only when
 * it finds a wrong answer (an error, an execution too many). Uses the suite's DATABASE_URL/REDIS_URL.
 */

const root = fileURLToPath(new URL('..', import.meta.url))

function run (script: string, out: string): Promise<{ code: number | null, output: string }> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, ['--expose-gc', '--import', 'tsx', script, '--quick', '--out', out], { cwd: root, env: process.env })
    let output = ''
    child.stdout.on('data', (chunk: Buffer) => { output += chunk.toString() })
    child.stderr.on('data', (chunk: Buffer) => { output += chunk.toString() })
    child.on('error', reject)
    child.on('close', (code) => resolve({ code, output }))
  })
}

t.test('npm run bench -- --quick writes a well-formed result and a chart', async (t) => {
  if (process.env.DATABASE_URL === undefined || process.env.REDIS_URL === undefined) return t.fail('DATABASE_URL and REDIS_URL must be set (npm test sets them)')
  const dir = mkdtempSync(join(tmpdir(), 'idem-bench-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const out = join(dir, 'result.json')
  const { code, output } = await run('benchmarks/run.ts', out)
  t.equal(code, 0, output.slice(-2000))
  const result = JSON.parse(readFileSync(out, 'utf8')) as { scenarios: Record<string, { setups: Array<Record<string, unknown>> }> }
  t.same(Object.keys(result.scenarios).sort(), ['fresh', 'fresh-64k', 'replay', 'replay-64k', 'storm'])
  for (const [name, scenario] of Object.entries(result.scenarios)) {
    t.ok(scenario.setups.some((row) => row.setup === 'bare'), `${name} has its baseline`)
    for (const row of scenario.setups) {
      t.ok(typeof row.requestsPerSecond === 'number' && row.requestsPerSecond > 0, `${name} ${String(row.setup)}: req/s`)
      t.equal(row.errors, 0, `${name} ${String(row.setup)}: no errors`)
      t.type(row.ratioToBare, 'number')
      t.type(row.p99Us, 'number')
    }
  }
  t.ok(existsSync(join(dir, 'chart.quick.svg')), 'the chart was written')
  t.match(readFileSync(join(dir, 'chart.quick.svg'), 'utf8'), /^<svg /)
})

t.test('npm run bench:memory -- --quick writes a well-formed result', async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'idem-bench-mem-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const out = join(dir, 'memory.json')
  const { code, output } = await run('benchmarks/memory.ts', out)
  t.equal(code, 0, output.slice(-2000))
  const result = JSON.parse(readFileSync(out, 'utf8')) as { capacity: { records: number, rssMiB: number }, steady: Array<{ mode: string, rssMiB: number[] }> }
  t.ok(result.capacity.records > 0 && result.capacity.rssMiB > 0)
  t.same(result.steady.map((run) => run.mode), ['replay', 'fresh-short-ttl'])
  t.ok(result.steady.every((run) => run.rssMiB.length >= 5), 'RSS was sampled through each run')
})

t.test('npm run bench:reference -- --quick writes a well-formed result', async (t) => {
  if (process.env.DATABASE_URL === undefined) return t.fail('DATABASE_URL must be set (npm test sets it)')
  const dir = mkdtempSync(join(tmpdir(), 'idem-bench-ref-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const out = join(dir, 'reference.json')
  const { code, output } = await run('benchmarks/reference.ts', out)
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
