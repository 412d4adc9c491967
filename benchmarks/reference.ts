/**
 * Responses by reference against full responses, side by side on PostgreSQL (lease mode):
 * `npm run bench:reference` (about 2 min), `-- --quick` (seconds; what test/benchmarks.test.ts runs),
 * `-- --out <file>` (default benchmarks/results/reference.json).
 *
 * Two app instances, identical but for the route option: `full` records every response body, `ref`
 * records `request.idempotency.reference` and rebuilds replays with one primary-key SELECT. Both
 * answer the same ~2 KiB payment (a realistic one: line items, addresses, metadata). Measured:
 * - storage: table size (heap + TOAST + indexes) and stored body bytes after the same N fresh keys;
 * - fresh keys/s while filling, and replays/s over recorded keys, in interleaved rounds (medians),
 *   as the ratio ref / full.
 * Uses DATABASE_URL, or starts a throwaway PostgreSQL (scripts/services.mjs).
 */
import { writeFileSync, mkdirSync } from 'node:fs'
import { dirname } from 'node:path'
import { randomBytes } from 'node:crypto'
import autocannon from 'autocannon'
import Fastify, { type FastifyInstance } from 'fastify'
import postgres from 'postgres'
import idempotency from '../lib/index.js'
import { postgresStore, type PostgresStore } from '../drivers/postgres/index.js'

const quick = process.argv.includes('--quick')
const outIndex = process.argv.indexOf('--out')
const out = outIndex > 0 ? process.argv[outIndex + 1] as string : new URL('./results/reference.json', import.meta.url).pathname
const RECORDS = quick ? 300 : 20_000
const SECONDS = quick ? 1 : 5
const ROUNDS = quick ? 1 : 3
const CONNECTIONS = 20
const REPLAY_KEYS = 100

interface Setup { name: 'full' | 'ref', app: FastifyInstance, store: PostgresStore, table: string, url: string }

function payment (id: string, amount: number): Record<string, unknown> {
  return {
    id,
    object: 'payment',
    amount,
    currency: 'eur',
    status: 'succeeded',
    created: 1_764_460_800,
    customer: { id: 'cus_8e03978e40d5', email: 'buyer@example.com', name: 'Ada Lovelace' },
    shipping: { line1: '12 Analytical Row', city: 'London', postal_code: 'EC1A 1BB', country: 'GB' },
    items: Array.from({ length: 12 }, (_, i) => ({ sku: `SKU-${1000 + i}`, description: `Difference engine part #${i}`, quantity: 1 + (i % 3), unit_amount: 1250 + i * 10 })),
    metadata: { order: `ord_${id}`, channel: 'web', campaign: 'winter-2026' }
  }
}

/** Loads a setup's POST /pay with the key `nextKey()` gives each request; requests per second, or a throw on any error or non-2xx. */
async function load (setup: Setup, bounds: { amount: number } | { duration: number, sampleInt: number }, nextKey: () => string, what: string): Promise<number> {
  const result = await autocannon({
    url: `${setup.url}/pay`,
    method: 'POST',
    connections: CONNECTIONS,
    ...bounds,
    headers: { 'content-type': 'application/json' },
    body: '{"amount":1000}',
    requests: [{ setupRequest: (request) => ({ ...request, headers: { ...request.headers, 'idempotency-key': `"${nextKey()}"` } }) }]
  })
  if (result.errors > 0 || result.non2xx > 0) throw new Error(`${setup.name}: ${result.errors} errors, ${result.non2xx} non-2xx while ${what}`)
  return result.requests.total / result.duration
}

async function main (): Promise<void> {
  let stopServices: (() => Promise<void>) | null = null
  let url = process.env.DATABASE_URL
  if (url === undefined || url === '') {
    // A computed specifier: services.mjs is plain JS without type declarations.
    const { startServices } = await import(new URL('../scripts/services.mjs', import.meta.url).href) as {
      startServices: (options: { redis: boolean, redisCluster: boolean }) => Promise<{ env: Record<string, string>, stop: () => Promise<void> }>
    }
    const services = await startServices({ redis: false, redisCluster: false })
    url = services.env.DATABASE_URL ?? ''
    stopServices = services.stop
  }
  const sql = postgres(url, { max: 20, onnotice: () => {} })
  const schema = `bench_reference_${randomBytes(3).toString('hex')}`
  await sql`CREATE SCHEMA ${sql(schema)}`
  await sql`CREATE TABLE ${sql(schema)}.payments (id text PRIMARY KEY, body jsonb NOT NULL)`
  const setups: Setup[] = []
  try {
    for (const name of ['full', 'ref'] as const) {
      const table = `records_${name}`
      const store = postgresStore({ sql, schema, table, purgeInterval: 0 })
      await store.migrate()
      const app = Fastify()
      await app.register(idempotency, { store, scope: () => 'bench' })
      const rebuild = async (reference: unknown): Promise<{ body: unknown }> => {
        const [row] = await sql`SELECT body FROM ${sql(schema)}.payments WHERE id = ${(reference as { id: string }).id}`
        return { body: row?.body }
      }
      app.post('/pay', { config: { idempotency: name === 'ref' ? { rebuild } : {} } }, async (request, reply) => {
        const id = `pay_${randomBytes(8).toString('hex')}`
        const body = payment(id, (request.body as { amount: number }).amount)
        await sql`INSERT INTO ${sql(schema)}.payments ${sql({ id, body: sql.json(body as never) })}`
        if (name === 'ref' && request.idempotency !== null) request.idempotency.reference = { id }
        return reply.code(201).send(body)
      })
      await app.listen({ host: '127.0.0.1', port: 0 })
      const address = app.server.address()
      setups.push({ name, app, store, table, url: `http://127.0.0.1:${typeof address === 'object' && address !== null ? address.port : 0}` })
    }

    // Fresh keys: N distinct keys per setup (the fill), one after the other.
    const fresh: Record<string, number> = {}
    for (const setup of setups) {
      let n = 0
      fresh[setup.name] = await load(setup, { amount: RECORDS }, () => `${setup.name}-${n++}`, 'filling')
    }

    const storage: Record<string, { records: number, tableBytes: number, bodyBytesPerRecord: number }> = {}
    for (const setup of setups) {
      const [row] = await sql`
        SELECT count(*)::int AS records, pg_total_relation_size(${`${schema}.${setup.table}`}::regclass)::float8 AS bytes,
               coalesce(avg(octet_length(response_body)), 0)::float8 AS body
        FROM ${sql(schema)}.${sql(setup.table)}`
      if (row?.records !== RECORDS) throw new Error(`${setup.name}: ${String(row?.records)} records, expected ${RECORDS}`)
      storage[setup.name] = { records: row.records, tableBytes: row.bytes, bodyBytesPerRecord: Math.round(row.body) }
    }

    // Replays over recorded keys, interleaved rounds.
    const replay: Record<string, number[]> = { full: [], ref: [] }
    for (let round = 0; round < ROUNDS; round++) {
      for (const setup of setups) {
        let n = 0
        replay[setup.name]?.push(await load(setup, { duration: SECONDS, sampleInt: 100 }, () => `${setup.name}-${n++ % REPLAY_KEYS}`, 'replaying'))
      }
    }
    const median = (values: number[]): number => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)] ?? NaN
    const full = storage.full as { tableBytes: number, bodyBytesPerRecord: number }
    const ref = storage.ref as { tableBytes: number, bodyBytesPerRecord: number }
    const result = {
      date: new Date().toISOString(),
      quick,
      node: process.version,
      records: RECORDS,
      responseBytes: Buffer.byteLength(JSON.stringify(payment('pay_0123456789abcdef', 1000))),
      storage,
      storageRatio: ref.tableBytes / full.tableBytes,
      freshPerSecond: fresh,
      freshRatio: (fresh.ref ?? NaN) / (fresh.full ?? NaN),
      replayPerSecond: { full: median(replay.full ?? []), ref: median(replay.ref ?? []) },
      replayRatio: median(replay.ref ?? []) / median(replay.full ?? [])
    }
    mkdirSync(dirname(out), { recursive: true })
    writeFileSync(out, JSON.stringify(result, null, 2) + '\n')
    const mib = (bytes: number): string => (bytes / 1024 / 1024).toFixed(1)
    process.stdout.write([
      `${RECORDS} records of a ${result.responseBytes}-byte response, PostgreSQL lease mode`,
      `table size: full ${mib(full.tableBytes)} MiB, by reference ${mib(ref.tableBytes)} MiB (×${result.storageRatio.toFixed(2)})`,
      `stored body per record: full ${full.bodyBytesPerRecord} B, by reference ${ref.bodyBytesPerRecord} B`,
      `fresh keys/s: full ${Math.round(fresh.full ?? 0)}, by reference ${Math.round(fresh.ref ?? 0)} (×${result.freshRatio.toFixed(2)})`,
      `replays/s: full ${Math.round(result.replayPerSecond.full)}, by reference ${Math.round(result.replayPerSecond.ref)} (×${result.replayRatio.toFixed(2)}; a rebuild is one SELECT)`,
      `written to ${out}`
    ].join('\n') + '\n')
  } finally {
    for (const setup of setups) {
      await setup.app.close()
      await setup.store.close()
    }
    await sql`DROP SCHEMA IF EXISTS ${sql(schema)} CASCADE`
    await sql.end({ timeout: 1 })
    if (stopServices !== null) await stopServices()
  }
}

main().catch((err: unknown) => {
  process.stderr.write(`${(err as Error).stack ?? String(err)}\n`)
  process.exit(1)
})
