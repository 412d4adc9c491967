import { spawn } from 'node:child_process'
import { fileURLToPath } from 'node:url'
import t from 'tap'

/**
 * Memory the memory store holds must be memory it counts, and must go when its records go. Each pattern runs in a child process of its own (--expose-gc, test/fixtures/memory-rss.ts)
 * that reports its memory after a full GC before the fill, after it, and after every short-lived
 * record expired and was purged.
 *
 * The child runs with glibc's mmap threshold fixed at its documented default (128 KiB) rather than
 * the dynamic one, so that a freed slab (256 KiB) is unmapped at once and the RSS shows what the
 * process still references; with the dynamic threshold glibc keeps freed slabs for reuse, and the RSS
 * stays at its peak (bounded by what the store counted) whatever the store released. arrayBuffers
 * and heapUsed, V8's own counts, are exact either way.
 *
 * Tolerances are wide (tens of MiB: a noisy two-core machine, a heap's own growth) against a gap
 * several times wider: a store whose slabs mix ttls holds 150 MiB of slabs after the first pattern's
 * records expired, and one whose interned header sets never go 256 MiB after the second's.
 */

const MiB = 1024 * 1024
const FIXTURE = fileURLToPath(new URL('../fixtures/memory-rss.ts', import.meta.url))

interface Sample { rss: number, external: number, arrayBuffers: number, heapUsed: number, bytes: number | null, records: number | null }
interface Report { scenario: string, maxBytes: number, before: Sample, filled: Sample, drained: Sample }

function measure (scenario: 'slabs' | 'headers'): Promise<Report> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, ['--expose-gc', '--import', 'tsx', FIXTURE, scenario], {
      env: { ...process.env, GLIBC_TUNABLES: 'glibc.malloc.mmap_threshold=131072' },
      stdio: ['ignore', 'pipe', 'inherit']
    })
    let output = ''
    child.stdout.on('data', (chunk: Buffer) => { output += chunk.toString() })
    child.on('error', reject)
    child.on('close', (code) => {
      try {
        if (code !== 0) throw new Error(`memory-rss ${scenario} exited with ${code}: ${output}`)
        resolve(JSON.parse(output.trim().split('\n').pop() as string) as Report)
      } catch (err) { reject(err) }
    })
  })
}

const grew = (report: Report, at: 'filled' | 'drained', field: 'rss' | 'arrayBuffers' | 'heapUsed'): number => report[at][field] - report.before[field]
const mib = (bytes: number): string => `${(bytes / MiB).toFixed(1)} MiB`

t.test('a long-lived record among short-lived ones does not keep their slab: slab memory is counted, and freed with its records', async (t) => {
  const report = await measure('slabs')
  t.comment(`before ${mib(report.before.rss)} RSS; filled +${mib(grew(report, 'filled', 'rss'))} RSS, +${mib(grew(report, 'filled', 'arrayBuffers'))} arrayBuffers, ` +
    `counted ${mib(report.filled.bytes ?? NaN)}; drained +${mib(grew(report, 'drained', 'rss'))} RSS, +${mib(grew(report, 'drained', 'arrayBuffers'))} arrayBuffers`)
  t.ok(grew(report, 'filled', 'arrayBuffers') <= report.maxBytes + 4 * MiB,
    `while full, the slabs held (${mib(grew(report, 'filled', 'arrayBuffers'))}) stay within maxBytes (${mib(report.maxBytes)})`)
  t.ok(grew(report, 'filled', 'rss') <= report.maxBytes + 32 * MiB, `while full, the RSS grew by ${mib(grew(report, 'filled', 'rss'))}: within maxBytes and a margin`)
  t.ok(grew(report, 'drained', 'arrayBuffers') <= 2 * MiB,
    `once the short-lived records expired, their slabs went (+${mib(grew(report, 'drained', 'arrayBuffers'))} left for 600 records of 16 bytes)`)
  t.ok(grew(report, 'drained', 'rss') <= 24 * MiB, `and the RSS returned near its baseline (+${mib(grew(report, 'drained', 'rss'))})`)
  t.ok(report.filled.bytes !== null, 'the store reports what it counts (usage())')
  t.ok((report.filled.bytes ?? 0) >= grew(report, 'filled', 'arrayBuffers') - 2 * MiB, 'what it counts covers the slab memory it holds')
  t.equal(report.drained.records, 600, 'the long-lived records are all kept')
  t.ok((report.drained.bytes ?? Infinity) <= 600 * 1024, `and counted as what they are (${report.drained.bytes ?? 'nothing'} bytes)`)
})

t.test('large header sets are counted while recorded and dropped from the interning table with their last record', async (t) => {
  const report = await measure('headers')
  t.comment(`before ${mib(report.before.rss)} RSS; filled +${mib(grew(report, 'filled', 'heapUsed'))} heap, counted ${mib(report.filled.bytes ?? NaN)}; ` +
    `drained +${mib(grew(report, 'drained', 'rss'))} RSS, +${mib(grew(report, 'drained', 'heapUsed'))} heap`)
  t.ok(grew(report, 'filled', 'heapUsed') <= report.maxBytes + 16 * MiB,
    `while full, the header sets held (${mib(grew(report, 'filled', 'heapUsed'))} of heap) stay within maxBytes (${mib(report.maxBytes)})`)
  t.ok(grew(report, 'drained', 'heapUsed') <= 16 * MiB, `once every record expired, the sets went (+${mib(grew(report, 'drained', 'heapUsed'))} of heap)`)
  t.ok(grew(report, 'drained', 'rss') <= 32 * MiB, `and the RSS returned near its baseline (+${mib(grew(report, 'drained', 'rss'))})`)
  t.equal(report.drained.records, 0, 'no record is left')
  t.equal(report.drained.bytes, 0, 'and nothing is counted')
})
