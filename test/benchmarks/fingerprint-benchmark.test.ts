import { spawn } from 'node:child_process'
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import t from 'tap'
import { readSummary } from '../../benchmarks/summary-file.js'

/*
 * `npm run bench:fingerprint -- --quick` runs and writes its section of a summary file. No figure
 * is judged here (timings belong to the benchmark, run on a quiet machine); the script itself throws
 * when the fingerprint and the reference implementation disagree on a body's digest.
 */

const root = fileURLToPath(new URL('../..', import.meta.url))

t.test('npm run bench:fingerprint -- --quick writes the fingerprint section', async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'idem-bench-fp-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const out = join(dir, 'summary.json')
  const { code, output } = await new Promise<{ code: number | null, output: string }>((resolve, reject) => {
    const child = spawn(process.execPath, ['--import', 'tsx', 'benchmarks/fingerprint.ts', '--quick', '--out', out], { cwd: root })
    let text = ''
    child.stdout.on('data', (chunk: Buffer) => { text += chunk.toString() })
    child.stderr.on('data', (chunk: Buffer) => { text += chunk.toString() })
    child.on('error', reject)
    child.on('close', (exit) => resolve({ code: exit, output: text }))
  })
  t.equal(code, 0, 'exit 0', { output })
  const section = readSummary(out).fingerprint!
  t.equal(section.rounds, 1)
  t.same(section.bodies.map((b) => b.name), ['200 B payment', '64 KiB line items', '1 MiB flat array of records', '1 MiB flat array of numbers', 'deep/wide object (6 levels x 8 members)'])
  for (const body of section.bodies) {
    t.ok(body.bytes > 0, `${body.name}: its size`)
    t.ok(body.parseMs > 0 && body.canonicalMs > 0 && body.keyedMs > 0, `${body.name}: each method timed`)
    t.equal(body.canonicalToParse, body.canonicalMs / body.parseMs, `${body.name}: its ratio to parsing`)
    t.equal(body.keyedToParse, body.keyedMs / body.parseMs, `${body.name}: the keyed form's ratio`)
  }
})
