/**
 * The memory store's footprint: `npm run bench:memory` (about a minute and a half; `-- --quick`:
 * seconds; `-- --out file`: another summary file). Fills the store with 1,000,000 completed records
 * of 200-byte bodies through the plugin (one POST per record through `app.inject`, the benchmark's
 * route) and measures the process after a full GC (--expose-gc, which the npm script passes).
 * --quick fills 50,000 and extrapolates to 1,000,000 with what the fill's second half cost per
 * record. Writes the `memory` section of benchmarks/results/summary.json.
 */
import { randomBytes } from 'node:crypto'
import { parseArgs } from 'node:util'
import Fastify from 'fastify'
import idempotency, { memoryStore } from '../lib/index.js'
import { BODY, PAY_SCHEMA } from './route.js'
import { summaryPath, writeSection } from './summary-file.js'

const { values: args } = parseArgs({ options: { quick: { type: 'boolean', default: false }, out: { type: 'string' } } })
const QUICK = args.quick === true
const FULL_RECORDS = 1_000_000
const RECORDS = QUICK ? 50_000 : FULL_RECORDS
const BODY_BYTES = 200
const mib = (bytes: number): number => Math.round(bytes / 2 ** 20)

async function fullGc (): Promise<NodeJS.MemoryUsage> {
  const gc = (globalThis as { gc?: () => void }).gc
  if (gc === undefined) throw new Error('benchmarks/memory.ts: run with --expose-gc (npm run bench:memory does)')
  for (let i = 0; i < 3; i++) {
    gc()
    await new Promise((resolve) => setImmediate(resolve))
  }
  return process.memoryUsage()
}

// Room for every record, no purge timer, and one scope allowed the whole store (its share is a quarter by default).
const store = memoryStore({ purgeInterval: 0, maxEntries: RECORDS + 1, maxBytes: 2 ** 33, maxEntriesPerScope: RECORDS + 1, maxBytesPerScope: 2 ** 33 })
const app = Fastify()
await app.register(idempotency, { store, scope: () => 'bench' })
let executed = 0
app.post('/pay', { schema: PAY_SCHEMA }, async (_request, reply) => {
  const body = { id: `pay_${String(executed++).padStart(12, '0')}`, amount: 1000, currency: 'EUR', description: '' }
  body.description = 'x'.repeat(BODY_BYTES - JSON.stringify(body).length) // exactly BODY_BYTES of JSON
  return reply.code(201).send(body)
})
const pay = async (key: string): Promise<void> => {
  const response = await app.inject({ method: 'POST', url: '/pay', headers: { 'content-type': 'application/json', 'idempotency-key': `"${key}"` }, payload: BODY })
  if (response.statusCode !== 201) throw new Error(`a fill request answered ${response.statusCode}: ${response.body}`)
}
/** Records [from, to), 32 requests at a time. */
async function fill (from: number, to: number): Promise<void> {
  for (let i = from; i < to; i += 32) await Promise.all(Array.from({ length: Math.min(32, to - i) }, async () => await pay(randomBytes(16).toString('hex'))))
  if (executed !== to) throw new Error(`${executed} executions for ${to} records`)
}

// The first record warms the route, so that the baseline holds what a running server holds.
await pay('warm')
const half = Math.floor(RECORDS / 2)
const before = await fullGc()
await fill(1, half)
const halfway = await fullGc()
await fill(half, RECORDS)
const after = await fullGc()
// What one more record costs, without the fixed costs a fill pays early (the young generation growing, the allocator's first arenas).
// RSS can also shrink between two samples (the allocator returning arenas, a loaded machine's GC
// timing): the second half then says nothing, and the whole fill's cost per record stands for it.
const marginal = after.rss > halfway.rss ? (after.rss - halfway.rss) / (RECORDS - half) : Math.max(0, (after.rss - before.rss) / (RECORDS - 1))
const rssFor1M = RECORDS === FULL_RECORDS ? after.rss : after.rss + marginal * (FULL_RECORDS - RECORDS)
const fillFigures = {
  records: RECORDS,
  rssMiB: mib(after.rss),
  heapUsedMiB: mib(after.heapUsed),
  arrayBuffersMiB: mib(after.arrayBuffers),
  rssBytesPerRecord: Math.round((after.rss - before.rss) / (RECORDS - 1)),
  rssMBFor1M: Math.round(rssFor1M / 1e6),
  extrapolated: RECORDS !== FULL_RECORDS
}
await app.close()
await store.close()
console.log(`${RECORDS.toLocaleString('en-US')} records of ${BODY_BYTES} B filled through the plugin: RSS ${fillFigures.rssMiB} MiB after a full GC ` +
  `(heap ${fillFigures.heapUsedMiB} MiB, arrayBuffers ${fillFigures.arrayBuffersMiB} MiB), ${fillFigures.rssBytesPerRecord} B of RSS per record; ` +
  `at 1,000,000 records: ${fillFigures.rssMBFor1M} MB${fillFigures.extrapolated ? ' (extrapolated)' : ''}`)
const out = summaryPath(args.out, QUICK)
writeSection(out, 'memory', { node: process.version, bodyBytes: BODY_BYTES, fill: fillFigures })
console.log(`written to ${out}`)
