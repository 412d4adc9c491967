/**
 * The cost of canonical fingerprints, as ratios to parsing the same body: `npm run bench:fingerprint`
 * (about 1 min), `-- --quick` (seconds), `-- --out <file>` (default benchmarks/results/fingerprint.json).
 *
 * A protected route already pays JSON.parse for its body (Fastify's parser); the fingerprint comes
 * on top, on every claim, replay and 422. Each body is measured, in interleaved rounds (medians),
 * four ways, all in this process:
 * - `parse`: JSON.parse of the body's text, the baseline;
 * - `recursive`: canonical-v1 as f203b40 computed it (recursive, the whole text built, then one
 *   SHA-256), kept in benchmarks/canonical-reference.ts, so the figure before the change is measured beside the one after;
 * - `canonical`: canonical-v1 now (lib/fingerprint.ts: the iterative walk, hashed in chunks);
 * - `keyed`: canonical plus the HMAC of keyed fingerprints (the `encryption` option).
 * Every run first checks that `recursive` and `canonical` give the same digest.
 */
import { randomBytes } from 'node:crypto'
import { mkdirSync, writeFileSync } from 'node:fs'
import { dirname } from 'node:path'
import { canonicalFingerprint } from '../lib/fingerprint.js'
import { referenceDigest } from './canonical-reference.js'
import { deriveFingerprintKeys, keyedFingerprint } from '../lib/fingerprint-keys.js'
import { resolveKeyring } from '../lib/keyring.js'

const quick = process.argv.includes('--quick')
const outIndex = process.argv.indexOf('--out')
const out = outIndex > 0 ? process.argv[outIndex + 1] as string : new URL('./results/fingerprint.json', import.meta.url).pathname
const ROUNDS = quick ? 1 : 9
/** Each measurement runs a method for at least this long. */
const SAMPLE_MS = quick ? 10 : 150

// ---------------------------------------------------------------------------------------------
// Bodies: what an API receives, from a small payment to the sizes of the finding.

function payment (i: number): Record<string, unknown> {
  return { currency: 'eur', amount: 1250 + i, customer: `cus_${i}`, description: `Order ${i}`, capture: true }
}

function lineItem (i: number): Record<string, unknown> {
  return { sku: `SKU-${1000 + i}`, quantity: 1 + (i % 3), unit_amount: 1250 + i * 10, description: `Difference engine part #${i}`, tax_rate: 0.2 }
}

/** Items made by `make` until the JSON text of their array reaches `bytes`. */
function arrayOf (bytes: number, make: (i: number) => unknown): unknown[] {
  const items: unknown[] = []
  let size = 2
  for (let i = 0; size < bytes; i++) {
    const item = make(i)
    size += JSON.stringify(item).length + 1
    items.push(item)
  }
  return items
}

/** An object `depth` levels deep, each level `width` members: half scalars, half nested objects. */
function deepWide (depth: number, width: number, seed = 0): unknown {
  const node: Record<string, unknown> = {}
  for (let i = width - 1; i >= 0; i--) {
    const name = `m${(i * 7 + seed) % width}_${i}`
    node[name] = depth > 0 && i % 2 === 0 ? deepWide(depth - 1, width, seed + i + 1) : (i % 4 === 1 ? `v${seed}-${i}` : seed * 31 + i)
  }
  return node
}

const BODIES: ReadonlyArray<{ name: string, text: string }> = [
  { name: '200 B payment', text: JSON.stringify({ ...payment(1), metadata: { order: 'ord_8e03978e40d5', channel: 'web' } }) },
  { name: '64 KiB line items', text: JSON.stringify({ order: 'ord_1', items: arrayOf(64 * 1024 - 30, lineItem) }) },
  { name: '1 MiB flat array of records', text: JSON.stringify(arrayOf(1024 * 1024, payment)) },
  { name: '1 MiB flat array of numbers', text: JSON.stringify(arrayOf(1024 * 1024, (i) => i * 1.5)) },
  { name: 'deep/wide object (6 levels x 8 members)', text: JSON.stringify(deepWide(6, 8)) }
]

// ---------------------------------------------------------------------------------------------

const keys = deriveFingerprintKeys(resolveKeyring({ keys: [{ id: 'bench', key: randomBytes(32) }] }))

type Method = 'parse' | 'recursive' | 'canonical' | 'keyed'
const METHODS: readonly Method[] = ['parse', 'recursive', 'canonical', 'keyed']

/** Milliseconds per call of `fn`, over at least SAMPLE_MS. */
function measure (fn: () => unknown): number {
  let calls = 0
  const started = performance.now()
  let elapsed = 0
  do {
    fn()
    calls++
    elapsed = performance.now() - started
  } while (elapsed < SAMPLE_MS)
  return elapsed / calls
}

function median (values: readonly number[]): number {
  const sorted = [...values].sort((a, b) => a - b)
  const mid = sorted.length >> 1
  return sorted.length % 2 === 1 ? sorted[mid] as number : ((sorted[mid - 1] as number) + (sorted[mid] as number)) / 2
}

interface BodyResult {
  readonly name: string
  readonly bytes: number
  /** Median milliseconds per call. */
  readonly ms: Record<Method, number>
  /** Medians of per-round ratios. */
  readonly ratios: { recursiveToParse: number, canonicalToParse: number, keyedToParse: number, recursiveToCanonical: number }
}

const results: BodyResult[] = []
for (const { name, text } of BODIES) {
  const body: unknown = JSON.parse(text)
  if (!referenceDigest('POST', '/pay', body).equals(canonicalFingerprint('POST', '/pay', body, 'application/json').digest)) {
    throw new Error(`${name}: the walk and the recursive implementation disagree`)
  }
  const run: Record<Method, () => unknown> = {
    parse: () => JSON.parse(text),
    recursive: () => referenceDigest('POST', '/pay', body),
    canonical: () => canonicalFingerprint('POST', '/pay', body, 'application/json'),
    keyed: () => keyedFingerprint(keys, canonicalFingerprint('POST', '/pay', body, 'application/json'))
  }
  // Warm-up: every method compiled before the first measured round.
  for (const method of METHODS) measure(run[method])
  const samples: Record<Method, number[]> = { parse: [], recursive: [], canonical: [], keyed: [] }
  const ratios = { recursiveToParse: [] as number[], canonicalToParse: [] as number[], keyedToParse: [] as number[], recursiveToCanonical: [] as number[] }
  for (let round = 0; round < ROUNDS; round++) {
    // Interleaved, in an order that changes every round, so drift hits every method alike.
    const order = METHODS.map((_, i) => METHODS[(i + round) % METHODS.length] as Method)
    const ms = {} as Record<Method, number>
    for (const method of order) ms[method] = measure(run[method])
    for (const method of METHODS) samples[method].push(ms[method])
    ratios.recursiveToParse.push(ms.recursive / ms.parse)
    ratios.canonicalToParse.push(ms.canonical / ms.parse)
    ratios.keyedToParse.push(ms.keyed / ms.parse)
    ratios.recursiveToCanonical.push(ms.recursive / ms.canonical)
  }
  results.push({
    name,
    bytes: Buffer.byteLength(text),
    ms: { parse: median(samples.parse), recursive: median(samples.recursive), canonical: median(samples.canonical), keyed: median(samples.keyed) },
    ratios: {
      recursiveToParse: median(ratios.recursiveToParse),
      canonicalToParse: median(ratios.canonicalToParse),
      keyedToParse: median(ratios.keyedToParse),
      recursiveToCanonical: median(ratios.recursiveToCanonical)
    }
  })
}

const fixed = (n: number, digits: number): string => n.toFixed(digits)
const rows = results.map((r) => [
  r.name, String(r.bytes), fixed(r.ms.parse, 3), fixed(r.ms.recursive, 3), fixed(r.ms.canonical, 3), fixed(r.ms.keyed, 3),
  `${fixed(r.ratios.recursiveToParse, 2)}x`, `${fixed(r.ratios.canonicalToParse, 2)}x`, `${fixed(r.ratios.keyedToParse, 2)}x`, `${fixed(r.ratios.recursiveToCanonical, 2)}x`
])
const header = ['body', 'bytes', 'parse ms', 'recursive ms', 'canonical ms', 'keyed ms', 'recursive/parse', 'canonical/parse', 'keyed/parse', 'speed-up']
const widths = header.map((h, i) => Math.max(h.length, ...rows.map((row) => (row[i] as string).length)))
for (const row of [header, ...rows]) console.log(row.map((cell, i) => i === 0 ? cell.padEnd(widths[i] as number) : cell.padStart(widths[i] as number)).join('  '))

mkdirSync(dirname(out), { recursive: true })
writeFileSync(out, JSON.stringify({
  node: process.version,
  quick,
  rounds: ROUNDS,
  sampleMs: SAMPLE_MS,
  bodies: results
}, null, 2) + '\n')
console.log(`\nwritten to ${out}`)
