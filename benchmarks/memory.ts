/**
 * Memory footprint of the embedded store (`npm run bench:memory`, `-- --quick` for a short run).
 *
 * 1. Capacity: the memory store holding 1,000,000 completed records with 200-byte bodies (the
 *    target is under 800 MB of RSS), filled through the store interface as the plugin fills it.
 * 2. Steady state: a server under load for 60 s (10 s quick) in its own process, sampled every
 *    second. With replays of a fixed key set nothing may grow; with fresh keys and a short ttl the
 *    purge must hold the store (and the RSS) level. Prints both series and writes
 *    benchmarks/results/memory.json.
 *
 * Run with --expose-gc (the npm script does) so the capacity figure is measured after a full GC.
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
import { memoryStore } from '../lib/index.js'

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const { values: args } = parseArgs({ options: { quick: { type: 'boolean', default: false }, child: { type: 'string' }, out: { type: 'string' } } })
const QUICK = args.quick === true
const RECORDS = QUICK ? 200_000 : 1_000_000
const SECONDS = QUICK ? 10 : 60
const mib = (bytes: number): number => Math.round(bytes / 1024 / 1024)

if (args.child !== undefined) await serve(args.child)
else await main()

async function main (): Promise<void> {
  const capacity = await fill()
  console.log(`capacity: ${RECORDS.toLocaleString('en-US')} completed 200-byte records → RSS ${capacity.rssMiB} MiB ` +
    `(heap ${capacity.heapMiB} MiB, external ${capacity.externalMiB} MiB; ${capacity.bytesPerRecord} bytes per record)`)
  const replays = await steady('replay')
  const fresh = await steady('fresh-short-ttl')
  for (const run of [replays, fresh]) {
    console.log(`${run.mode}: RSS by second (MiB) ${run.rssMiB.join(' ')}; growth from the middle to the last third ${run.growthPercent}%`)
  }
  const result = {
    date: new Date().toISOString(),
    quick: QUICK,
    machine: { cpuModel: os.cpus()[0]?.model, cores: os.cpus().length, node: process.version },
    capacity: { records: RECORDS, ...capacity, targetMiB: 800, met: RECORDS === 1_000_000 ? capacity.rssMiB < 800 : null },
    steady: [replays, fresh]
  }
  const out = args.out ?? path.join(ROOT, 'benchmarks', 'results', QUICK ? 'memory.quick.json' : 'memory.json')
  writeFileSync(out, JSON.stringify(result, null, 2) + '\n')
  console.log(`[bench] wrote ${path.relative(ROOT, out)}`)
}

/** Fills a memory store through its interface, as the plugin does for fresh keys, and measures. */
async function fill (): Promise<{ rssMiB: number, heapMiB: number, externalMiB: number, bytesPerRecord: number }> {
  const gc = (globalThis as { gc?: () => void }).gc ?? (() => {})
  gc()
  const before = process.memoryUsage()
  const store = memoryStore({ purgeInterval: 0, maxEntries: RECORDS + 1, maxBytes: 2 ** 31 })
  const fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('x').digest() }
  const headers = { 'content-type': 'application/json; charset=utf-8' }
  for (let i = 0; i < RECORDS; i++) {
    const key = `${randomBytes(16).toString('hex')}`
    const claim = await store.claim({ scope: 'tenant', key, fingerprint: { algorithm: fingerprint.algorithm, digest: createHash('sha256').update(key).digest() }, leaseMs: 30_000, ttlMs: 86_400_000 })
    if (claim.outcome !== 'acquired') throw new Error('not acquired')
    const body = Buffer.from(JSON.stringify({ id: `pay_${String(i).padStart(12, '0')}`, amount: 1000, currency: 'EUR', description: 'x'.repeat(128) }).slice(0, 200))
    await store.complete(claim.lease, { statusCode: 201, headers, body }, 86_400_000)
  }
  gc()
  const after = process.memoryUsage()
  const result = {
    rssMiB: mib(after.rss),
    heapMiB: mib(after.heapUsed),
    externalMiB: mib(after.external),
    bytesPerRecord: Math.round((after.rss - before.rss) / RECORDS)
  }
  await store.close()
  return result
}

/** One server under load for SECONDS, its RSS sampled every second from /proc. */
async function steady (mode: 'replay' | 'fresh-short-ttl'): Promise<{ mode: string, rssMiB: number[], growthPercent: number }> {
  const child = spawn(process.execPath, ['--import', 'tsx', fileURLToPath(import.meta.url), '--child', mode], { cwd: ROOT, stdio: ['ignore', 'pipe', 'inherit'] })
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
    body: '{"amount":1000,"currency":"EUR"}',
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
  const { default: idempotency } = await import('../lib/index.js')
  const app = Fastify()
  const short = mode === 'fresh-short-ttl'
  await app.register(idempotency, {
    scope: () => 'bench',
    store: memoryStore({ purgeInterval: short ? 1000 : 60_000 }),
    ...(short ? { ttl: 2000, lease: 1000 } : {})
  })
  app.post('/pay', async (_request, reply) => reply.code(201).send({ id: 'pay_1', amount: 1000, currency: 'EUR', padding: 'x'.repeat(120) }))
  await app.listen({ host: '127.0.0.1', port: 0 })
  const address = app.server.address()
  process.stdout.write(JSON.stringify({ port: typeof address === 'object' && address !== null ? address.port : 0 }) + '\n')
  process.once('SIGTERM', () => process.exit(0))
}
