/**
 * The cost of canonical fingerprints against parsing the same body: `npm run bench:fingerprint`
 * (about a minute; `-- --quick`: seconds; `-- --out file`: another summary file). A protected route
 * already pays JSON.parse for its body (Fastify's parser); the fingerprint (lib/core/fingerprint.ts)
 * comes on top, on every claim, replay and 422, and with the `encryption` option an HMAC of it
 * (`keyed`). Each body is timed three ways in interleaved rounds whose order rotates (medians).
 * Before timing, the digest of every body is checked against the recursive reference
 * implementation (test/helpers/canonical-reference.ts): a changed byte would answer every stored record's retries 422.
 * Writes the `fingerprint` section of benchmarks/results/summary.json.
 */
import { randomBytes } from 'node:crypto'
import { parseArgs } from 'node:util'
import { canonicalFingerprint } from '../lib/core/fingerprint.js'
import { deriveFingerprintKeys, keyedFingerprint } from '../lib/core/fingerprint-keys.js'
import { resolveKeyring } from '../lib/core/keyring.js'
import { referenceDigest } from '../test/helpers/canonical-reference.js'
import { median } from './figures.js'
import { summaryPath, writeSection, type FingerprintSection } from './summary-file.js'

const { values: args } = parseArgs({ options: { quick: { type: 'boolean', default: false }, out: { type: 'string' } } })
const quick = args.quick === true
const ROUNDS = quick ? 1 : 9
/** Each timing runs its method for at least this long. */
const SAMPLE_MS = quick ? 10 : 150

const payment = (i: number): unknown => ({ currency: 'eur', amount: 1250 + i, customer: `cus_${i}`, description: `Order ${i}`, capture: true })
const lineItem = (i: number): unknown => ({ sku: `SKU-${1000 + i}`, quantity: 1 + (i % 3), unit_amount: 1250 + i * 10, description: `Difference engine part #${i}`, tax_rate: 0.2 })

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
  { name: '200 B payment', text: JSON.stringify({ ...payment(1) as object, metadata: { order: 'ord_8e03978e40d5', channel: 'web' } }) },
  { name: '64 KiB line items', text: JSON.stringify({ order: 'ord_1', items: arrayOf(64 * 1024 - 30, lineItem) }) },
  { name: '1 MiB flat array of records', text: JSON.stringify(arrayOf(1024 * 1024, payment)) },
  { name: '1 MiB flat array of numbers', text: JSON.stringify(arrayOf(1024 * 1024, (i) => i * 1.5)) },
  { name: 'deep/wide object (6 levels x 8 members)', text: JSON.stringify(deepWide(6, 8)) }
]

const keys = deriveFingerprintKeys(resolveKeyring({ keys: [{ id: 'bench', key: randomBytes(32) }] }))
const METHODS = ['parse', 'canonical', 'keyed'] as const
type Method = typeof METHODS[number]

/** Milliseconds per call of `fn`, over at least SAMPLE_MS. */
function measure (fn: () => unknown): number {
  const started = performance.now()
  let calls = 0
  for (; performance.now() - started < SAMPLE_MS; calls++) fn()
  return (performance.now() - started) / calls
}

const results: FingerprintSection['bodies'] = []
for (const { name, text } of BODIES) {
  const body: unknown = JSON.parse(text)
  if (!referenceDigest('POST', '/pay', body).equals(canonicalFingerprint('POST', '/pay', body, 'application/json').digest)) {
    throw new Error(`${name}: the fingerprint and the reference implementation disagree`)
  }
  const run: Record<Method, () => unknown> = {
    parse: () => JSON.parse(text),
    canonical: () => canonicalFingerprint('POST', '/pay', body, 'application/json'),
    keyed: () => keyedFingerprint(keys, canonicalFingerprint('POST', '/pay', body, 'application/json'))
  }
  for (const method of METHODS) measure(run[method]) // warm-up: every method compiled first
  const ms: Record<Method, number[]> = { parse: [], canonical: [], keyed: [] }
  for (let round = 0; round < ROUNDS; round++) {
    for (let i = 0; i < METHODS.length; i++) {
      const method = METHODS[(i + round) % METHODS.length]!
      ms[method].push(measure(run[method]))
    }
  }
  const [parseMs, canonicalMs, keyedMs] = METHODS.map((method) => median(ms[method]))
  results.push({ name, bytes: Buffer.byteLength(text), parseMs: parseMs!, canonicalMs: canonicalMs!, keyedMs: keyedMs!, canonicalToParse: canonicalMs! / parseMs!, keyedToParse: keyedMs! / parseMs! })
}

for (const r of results) {
  console.log(`${r.name.padEnd(40)} ${String(r.bytes).padStart(8)} B  parse ${r.parseMs.toFixed(3)} ms  fingerprint ${r.canonicalMs.toFixed(3)} ms (${r.canonicalToParse.toFixed(2)}×)  keyed ${r.keyedMs.toFixed(3)} ms (${r.keyedToParse.toFixed(2)}×)`)
}
const out = summaryPath(args.out, quick)
writeSection(out, 'fingerprint', { node: process.version, rounds: ROUNDS, bodies: results })
console.log(`written to ${out}`)
