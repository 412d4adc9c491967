import { spawn } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import t from 'tap'

/*
 * `npm run bench:fingerprint -- --quick` starts and writes a well-formed result. No figure is
 * judged here (timings belong to the benchmark, run on a quiet machine); the script itself throws
 * when the walk and the recursive implementation disagree on a body's digest.
 */

const root = fileURLToPath(new URL('..', import.meta.url))

t.test('npm run bench:fingerprint -- --quick writes a well-formed result', async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'idem-bench-fp-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const out = join(dir, 'fingerprint.json')
  const { code, output } = await new Promise<{ code: number | null, output: string }>((resolve, reject) => {
    const child = spawn(process.execPath, ['--import', 'tsx', 'benchmarks/fingerprint.ts', '--quick', '--out', out], { cwd: root })
    let text = ''
    child.stdout.on('data', (chunk: Buffer) => { text += chunk.toString() })
    child.stderr.on('data', (chunk: Buffer) => { text += chunk.toString() })
    child.on('error', reject)
    child.on('close', (exit) => resolve({ code: exit, output: text }))
  })
  t.equal(code, 0, output)
  const result = JSON.parse(readFileSync(out, 'utf8')) as { quick: boolean, bodies: Array<{ name: string, bytes: number, ms: Record<string, number>, ratios: Record<string, number> }> }
  t.equal(result.quick, true)
  t.same(result.bodies.map((b) => b.name), ['200 B payment', '64 KiB line items', '1 MiB flat array of records', '1 MiB flat array of numbers', 'deep/wide object (6 levels x 8 members)'])
  for (const body of result.bodies) {
    t.ok(body.bytes > 0, `${body.name}: its size`)
    for (const method of ['parse', 'recursive', 'canonical', 'keyed']) t.ok(body.ms[method]! > 0, `${body.name}: ${method} measured`)
    for (const ratio of ['recursiveToParse', 'canonicalToParse', 'keyedToParse', 'recursiveToCanonical']) t.ok(Number.isFinite(body.ratios[ratio]), `${body.name}: ${ratio}`)
  }
})
