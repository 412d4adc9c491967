/**
 * Memory footprint of the embedded store (`npm run bench:memory`, `-- --quick` for a short run).
 *
 * 1. Capacity: the memory store holding 1,000,000 completed records with 200-byte bodies, filled two
 *    ways, each in a process of its own (--expose-gc), measured after a full GC: RSS, heap,
 *    external and arrayBuffers, in all and per record.
 *    - through the plugin (issue 14's target, ≤ 500 MB RSS): one POST per record through
 *      `app.inject`, with the benchmark's route (JSON body schema) answering a 200-byte payment;
 *    - through the store interface (claim, then complete), as a lower bound: what the records cost
 *      without the requests that made them.
 *    --quick fills 50,000 records and extrapolates to 1,000,000 with what the second half of its
 *    fill cost per record (a rough figure: the full run measures).
 * 2. Steady state: a server under load for 60 s (5 s quick) in its own process, sampled every
 *    second. With replays of a fixed key set nothing may grow; with fresh keys and a short ttl the
 *    purge must hold the store (and the RSS) level. Prints both series and writes
 *    benchmarks/results/memory.json (memory.quick.json with --quick).
 */
import { spawn } from 'node:child_process'
import { randomBytes, createHash } from 'node:crypto'
import { writeFileSync, readFileSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import autocannon from 'autocannon'
import { BODY, PAY_SCHEMA } from './route.js'

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const { values: args } = parseArgs({ options: { quick: { type: 'boolean', default: false }, child: { type: 'string' }, out: { type: 'string' } } })
const QUICK = args.quick === true
const FULL_RECORDS = 1_000_000
const RECORDS = QUICK ? 50_000 : FULL_RECORDS
const SECONDS = QUICK ? 5 : 60
/** Issue 14: 1M completed 200-byte records, filled through the plugin, in at most 500 MB of RSS. */
const TARGET_BYTES = 500e6
const BODY_BYTES = 200
const mib = (bytes: number): number => Math.round(bytes / 1024 / 1024)

interface Capacity {
  method: 'plugin' | 'store'
  records: number
  seconds: number
  /** After a full GC, with the store full. */
  rssMiB: number
  heapUsedMiB: number
  heapTotalMiB: number
  externalMiB: number
  arrayBuffersMiB: number
  /** The same process before the fill (after a full GC): what the records add is the difference. */
  baselineRssMiB: number
  /** (after − before) / records. */
  bytesPerRecord: PerRecord
  /**
   * (after − halfway) / (records / 2), both after a full GC: what one more record costs, without
   * the fixed costs a fill pays early (the young generation growing, the allocator's first arenas).
   */
  marginalBytesPerRecord: PerRecord
  /** The RSS at 1,000,000 records: measured, or (--quick) extrapolated with the marginal cost. */
  rssFor1MMiB: number
  rssFor1MMB: number
}

interface PerRecord { rss: number, heapUsed: number, external: number, arrayBuffers: number }

if (args.child === 'steady-replay' || args.child === 'steady-fresh-short-ttl') await serve(args.child)
else if (args.child === 'capacity-plugin' || args.child === 'capacity-store') await capacityChild(args.child === 'capacity-plugin' ? 'plugin' : 'store')
else await main()

async function main (): Promise<void> {
  const plugin = await capacity('plugin')
  const store = await capacity('store')
  for (const c of [plugin, store]) {
    console.log(`capacity (${c.method === 'plugin' ? 'through the plugin: POSTs through app.inject' : 'through the store interface'}): ` +
      `${c.records.toLocaleString('en-US')} completed ${BODY_BYTES}-byte records in ${c.seconds} s → RSS ${c.rssMiB} MiB after a full GC ` +
      `(heap ${c.heapUsedMiB} MiB used of ${c.heapTotalMiB}, external ${c.externalMiB} MiB, arrayBuffers ${c.arrayBuffersMiB} MiB; before the fill ${c.baselineRssMiB} MiB); ` +
      `per record: RSS ${c.bytesPerRecord.rss} B, heap ${c.bytesPerRecord.heapUsed} B, external ${c.bytesPerRecord.external} B, arrayBuffers ${c.bytesPerRecord.arrayBuffers} B ` +
      `(the second half's: RSS ${c.marginalBytesPerRecord.rss} B, heap ${c.marginalBytesPerRecord.heapUsed} B, external ${c.marginalBytesPerRecord.external} B)` +
      (c.records === FULL_RECORDS ? '' : `; extrapolated to 1,000,000 records with the second half's cost: RSS ${c.rssFor1MMiB} MiB (${c.rssFor1MMB} MB)`))
  }
  const met = plugin.rssFor1MMB * 1e6 <= TARGET_BYTES
  console.log(`target (issue 14): 1,000,000 records filled through the plugin ≤ ${TARGET_BYTES / 1e6} MB RSS: ${plugin.rssFor1MMB} MB` +
    `${plugin.records === FULL_RECORDS ? '' : ' (extrapolated)'} → ${met ? 'met' : `missed (by ${Math.round(plugin.rssFor1MMB - TARGET_BYTES / 1e6)} MB)`}`)
  const replays = await steady('replay')
  const fresh = await steady('fresh-short-ttl')
  for (const run of [replays, fresh]) {
    console.log(`${run.mode}: RSS by second (MiB) ${run.rssMiB.join(' ')}; growth from the middle to the last third ${run.growthPercent}%`)
  }
  const result = {
    date: new Date().toISOString(),
    quick: QUICK,
    machine: { cpuModel: os.cpus()[0]?.model, cores: os.cpus().length, node: process.version },
    capacity: {
      records: RECORDS,
      bodyBytes: BODY_BYTES,
      plugin,
      store,
      // The figure the previous format reported (the store-interface fill), kept for comparisons.
      rssMiB: store.rssMiB,
      target: { records: FULL_RECORDS, maxRssMB: TARGET_BYTES / 1e6, method: 'plugin', measuredMB: plugin.rssFor1MMB, extrapolated: plugin.records !== FULL_RECORDS, met }
    },
    steady: [replays, fresh]
  }
  const out = args.out ?? path.join(ROOT, 'benchmarks', 'results', QUICK ? 'memory.quick.json' : 'memory.json')
  writeFileSync(out, JSON.stringify(result, null, 2) + '\n')
  console.log(`[bench] wrote ${path.relative(ROOT, out)}`)
}

/** Runs one capacity fill in a new process (so that neither fill inherits the other's heap). */
function capacity (method: 'plugin' | 'store'): Promise<Capacity> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, ['--expose-gc', '--import', 'tsx', fileURLToPath(import.meta.url), '--child', `capacity-${method}`, ...(QUICK ? ['--quick'] : [])],
      { cwd: ROOT, stdio: ['ignore', 'pipe', 'inherit'] })
    let result: Capacity | null = null
    createInterface({ input: child.stdout }).on('line', (line) => {
      try { result = (JSON.parse(line) as { capacity?: Capacity }).capacity ?? result } catch {}
    })
    child.once('exit', (code) => result !== null && code === 0 ? resolve(result) : reject(new Error(`capacity-${method} exited with ${code}`)))
  })
}

/** A completed payment of exactly BODY_BYTES bytes of JSON. */
function body200 (i: number): Record<string, unknown> {
  const base = { id: `pay_${String(i).padStart(12, '0')}`, amount: 1000, currency: 'EUR', description: '' }
  base.description = 'x'.repeat(BODY_BYTES - JSON.stringify(base).length)
  return base
}

async function fullGc (): Promise<NodeJS.MemoryUsage> {
  const gc = (globalThis as { gc?: () => void }).gc
  if (gc === undefined) throw new Error('benchmarks/memory.ts: run with --expose-gc (npm run bench:memory does)')
  for (let i = 0; i < 3; i++) {
    gc()
    await new Promise((resolve) => setImmediate(resolve))
  }
  return process.memoryUsage()
}

async function capacityChild (method: 'plugin' | 'store'): Promise<void> {
  const { default: idempotency, memoryStore } = await import('../lib/index.js')
  // The same store in both fills: room for every record, no purge timer, and one scope ('bench')
  // allowed the whole store (its share is a quarter by default).
  const store = memoryStore({ purgeInterval: 0, maxEntries: RECORDS + 1, maxBytes: 2 ** 33, maxEntriesPerScope: RECORDS + 1, maxBytesPerScope: 2 ** 33 })
  /** Fills records [from, to). */
  let fill: (from: number, to: number) => Promise<void>
  if (method === 'plugin') {
    const { default: Fastify } = await import('fastify')
    const app = Fastify()
    await app.register(idempotency, { store, scope: () => 'bench' })
    let executed = 0
    app.post('/pay', { schema: PAY_SCHEMA }, async (_request, reply) => reply.code(201).send(body200(executed++)))
    await app.ready()
    // Warm the route once, so that the baseline holds what a running server holds.
    await app.inject({ method: 'POST', url: '/pay', headers: { 'content-type': 'application/json', 'idempotency-key': '"warm"' }, payload: BODY })
    fill = async (from, to) => {
      const BATCH = 32
      for (let i = from; i < to; i += BATCH) {
        const responses = await Promise.all(Array.from({ length: Math.min(BATCH, to - i) }, () => app.inject({
          method: 'POST',
          url: '/pay',
          headers: { 'content-type': 'application/json', 'idempotency-key': `"${randomBytes(16).toString('hex')}"` },
          payload: BODY
        })))
        for (const response of responses) if (response.statusCode !== 201) throw new Error(`a fill request answered ${response.statusCode}: ${response.body}`)
      }
      if (executed !== to) throw new Error(`${executed} executions for ${to} records`)
    }
  } else {
    const headers = { 'content-type': 'application/json; charset=utf-8' }
    fill = async (from, to) => {
      for (let i = from; i < to; i++) {
        const key = randomBytes(16).toString('hex')
        const claim = await store.claim({ scope: 'bench', key, fingerprint: { algorithm: 'canonical-v1', digest: createHash('sha256').update(key).digest() }, leaseMs: 30_000, ttlMs: 86_400_000 })
        if (claim.outcome !== 'acquired') throw new Error('not acquired')
        await store.complete(claim.lease, { statusCode: 201, headers, body: Buffer.from(JSON.stringify(body200(i))) }, 86_400_000)
      }
    }
  }
  // The plugin's fill starts at 1: its warm-up request recorded the first record.
  const first = method === 'plugin' ? 1 : 0
  const half = Math.floor(RECORDS / 2)
  const before = await fullGc()
  const started = performance.now()
  await fill(first, half)
  const halfway = await fullGc()
  await fill(half, RECORDS)
  const seconds = Math.round((performance.now() - started) / 100) / 10
  const after = await fullGc()
  const per = (from: NodeJS.MemoryUsage, records: number): PerRecord => {
    const of = (key: keyof PerRecord): number => Math.round((after[key] - from[key]) / records)
    return { rss: of('rss'), heapUsed: of('heapUsed'), external: of('external'), arrayBuffers: of('arrayBuffers') }
  }
  const bytesPerRecord = per(before, RECORDS - first)
  const marginalBytesPerRecord = per(halfway, RECORDS - half)
  const rssFor1M = RECORDS === FULL_RECORDS ? after.rss : after.rss + marginalBytesPerRecord.rss * (FULL_RECORDS - RECORDS)
  const result: Capacity = {
    method,
    records: RECORDS,
    seconds,
    rssMiB: mib(after.rss),
    heapUsedMiB: mib(after.heapUsed),
    heapTotalMiB: mib(after.heapTotal),
    externalMiB: mib(after.external),
    arrayBuffersMiB: mib(after.arrayBuffers),
    baselineRssMiB: mib(before.rss),
    bytesPerRecord,
    marginalBytesPerRecord,
    rssFor1MMiB: mib(rssFor1M),
    rssFor1MMB: Math.round(rssFor1M / 1e6)
  }
  process.stdout.write(JSON.stringify({ capacity: result }) + '\n')
  await store.close()
  process.exit(0)
}

/** One server under load for SECONDS, its RSS sampled every second from /proc. */
async function steady (mode: 'replay' | 'fresh-short-ttl'): Promise<{ mode: string, rssMiB: number[], growthPercent: number }> {
  const child = spawn(process.execPath, ['--import', 'tsx', fileURLToPath(import.meta.url), '--child', `steady-${mode}`], { cwd: ROOT, stdio: ['ignore', 'pipe', 'inherit'] })
  const port = await new Promise<number>((resolve, reject) => {
    createInterface({ input: child.stdout! }).on('line', (line) => {
      const value = (JSON.parse(line) as { port?: number }).port
      if (typeof value === 'number') resolve(value)
    })
    child.once('exit', (code) => reject(new Error(`server exited (${code})`)))
  })
  const samples: number[] = []
  const sampler = setInterval(() => {
    const match = /^VmRSS:\s+(\d+) kB/m.exec(readFileSync(`/proc/${child.pid}/status`, 'utf8'))
    samples.push(match === null ? NaN : Math.round(Number(match[1]) / 1024))
  }, 1000)
  let n = 0
  const tag = randomBytes(4).toString('hex')
  await autocannon({
    url: `http://127.0.0.1:${port}/pay`,
    connections: 10,
    duration: SECONDS,
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: BODY,
    requests: [{
      setupRequest (request) {
        (request.headers ??= {})['idempotency-key'] = mode === 'replay' ? `"r-${n++ % 100}-${tag}"` : `"f-${n++}-${tag}"`
        return request
      }
    }]
  })
  clearInterval(sampler)
  child.kill('SIGTERM')
  return { mode, rssMiB: samples, growthPercent: growth(samples) }
}

/**
 * Growth between the middle and the last third of a run, by their means: the RSS of a collected
 * heap is a sawtooth, so comparing two single samples would measure where the GC happened to be.
 */
export function growth (samples: number[]): number {
  const third = Math.floor(samples.length / 3)
  const mean = (values: number[]): number => values.reduce((sum, v) => sum + v, 0) / values.length
  const middle = mean(samples.slice(third, 2 * third))
  const last = mean(samples.slice(2 * third))
  return Math.round((last - middle) / middle * 1000) / 10
}

/** The server of a steady-state run: the plugin on the memory store; short ttl for fresh keys. */
async function serve (mode: string): Promise<void> {
  const { default: Fastify } = await import('fastify')
  const { default: idempotency, memoryStore } = await import('../lib/index.js')
  const app = Fastify()
  const short = mode === 'steady-fresh-short-ttl'
  await app.register(idempotency, {
    scope: () => 'bench',
    store: memoryStore({ purgeInterval: short ? 1000 : 60_000 }),
    ...(short ? { ttl: 2000, lease: 1000 } : {})
  })
  app.post('/pay', { schema: PAY_SCHEMA }, async (_request, reply) => reply.code(201).send(body200(1)))
  await app.listen({ host: '127.0.0.1', port: 0 })
  const address = app.server.address()
  process.stdout.write(JSON.stringify({ port: typeof address === 'object' && address !== null ? address.port : 0 }) + '\n')
  process.once('SIGTERM', () => process.exit(0))
}
