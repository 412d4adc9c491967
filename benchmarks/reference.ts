/**
 * Responses by reference against full responses on PostgreSQL (lease mode): `npm run bench:reference`
 * (about 2 min; `-- --quick`: seconds; `-- --out file`: another summary file). Two apps identical but
 * for the route option: `full` records every ~1.5 KiB payment body, `ref` records a reference and
 * rebuilds replays with one primary-key SELECT. Measured: table size and stored body bytes after the
 * same fresh keys, fresh keys/s, replays/s (interleaved rounds, medians). Writes the `reference`
 * section of benchmarks/results/summary.json.
 */
import { randomBytes } from 'node:crypto'
import { parseArgs } from 'node:util'
import autocannon from 'autocannon'
import Fastify, { type FastifyInstance } from 'fastify'
import postgres from 'postgres'
import idempotency from '../lib/index.js'
import { postgresStore, type PostgresStore } from '../drivers/postgres/index.js'
import { median } from './figures.js'
import { benchServices } from './services.js'
import { summaryPath, writeSection, type ReferenceSide } from './summary-file.js'

const { values: args } = parseArgs({ options: { quick: { type: 'boolean', default: false }, out: { type: 'string' } } })
const quick = args.quick === true
const RECORDS = quick ? 300 : 20_000
const SECONDS = quick ? 1 : 5
const ROUNDS = quick ? 1 : 3
const CONNECTIONS = 20
const REPLAY_KEYS = 100

interface Setup { name: 'full' | 'ref', app: FastifyInstance, store: PostgresStore, table: string, url: string }

/** A realistic payment: line items, addresses, metadata. */
const payment = (id: string, amount: number): Record<string, unknown> => ({
  id,
  object: 'payment',
  amount,
  currency: 'eur',
  status: 'succeeded',
  created: 1_764_460_800,
  customer: { id: 'cus_8e03978e40d5', email: 'buyer@example.com', name: 'Ada Lovelace' },
  shipping: { line1: '12 Analytical Row', city: 'London', postal_code: 'EC1A 1BB', country: 'GB' },
  items: Array.from({ length: 12 }, (_, i) => ({ sku: `SKU-${1000 + i}`, description: `Difference engine part #${i}`, quantity: 1 + (i % 3), unit_amount: 1250 + i * 10 })),
  metadata: { order: `ord_${id}`, channel: 'web' }
})

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
  const services = await benchServices()
  const sql = postgres(services.databaseUrl, { max: 20, onnotice: () => {} })
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

    const sides: Partial<Record<'full' | 'ref', ReferenceSide>> = {}
    for (const setup of setups) {
      const [row] = await sql`
        SELECT count(*)::int AS records, pg_total_relation_size(${`${schema}.${setup.table}`}::regclass)::float8 AS bytes,
               coalesce(avg(octet_length(response_body)), 0)::float8 AS body
        FROM ${sql(schema)}.${sql(setup.table)}`
      if (row?.records !== RECORDS) throw new Error(`${setup.name}: ${String(row?.records)} records, expected ${RECORDS}`)
      sides[setup.name] = { tableBytes: row.bytes, bodyBytesPerRecord: Math.round(row.body), freshPerSecond: Math.round(fresh[setup.name]!), replayPerSecond: 0 }
    }

    // Replays over recorded keys, interleaved rounds.
    const replay: Record<string, number[]> = { full: [], ref: [] }
    for (let round = 0; round < ROUNDS; round++) {
      for (const setup of setups) {
        let n = 0
        replay[setup.name]!.push(await load(setup, { duration: SECONDS, sampleInt: 100 }, () => `${setup.name}-${n++ % REPLAY_KEYS}`, 'replaying'))
      }
    }
    const full = { ...sides.full!, replayPerSecond: Math.round(median(replay.full!)) }
    const ref = { ...sides.ref!, replayPerSecond: Math.round(median(replay.ref!)) }
    const round3 = (value: number): number => Math.round(value * 1000) / 1000
    const responseBytes = Buffer.byteLength(JSON.stringify(payment('pay_0123456789abcdef', 1000)))
    const ratios = { tableBytes: round3(ref.tableBytes / full.tableBytes), fresh: round3(ref.freshPerSecond / full.freshPerSecond), replay: round3(ref.replayPerSecond / full.replayPerSecond) }
    const out = summaryPath(args.out, quick)
    writeSection(out, 'reference', { records: RECORDS, responseBytes, full, ref, ratios })
    const mib = (bytes: number): string => (bytes / 2 ** 20).toFixed(1)
    console.log([
      `${RECORDS} records of a ${responseBytes}-byte response, PostgreSQL lease mode; full response, then by reference`,
      `table size: ${mib(full.tableBytes)} MiB, ${mib(ref.tableBytes)} MiB (×${ratios.tableBytes})`,
      `stored body per record: ${full.bodyBytesPerRecord} B, ${ref.bodyBytesPerRecord} B`,
      `fresh keys/s: ${full.freshPerSecond}, ${ref.freshPerSecond} (×${ratios.fresh})`,
      `replays/s: ${full.replayPerSecond}, ${ref.replayPerSecond} (×${ratios.replay}; a rebuild is one SELECT)`,
      `written to ${out}`
    ].join('\n'))
  } finally {
    for (const setup of setups) {
      await setup.app.close()
      await setup.store.close()
    }
    await sql`DROP SCHEMA IF EXISTS ${sql(schema)} CASCADE`
    await sql.end({ timeout: 1 })
    await services.stop()
  }
}

main().catch((err: unknown) => {
  process.stderr.write(`${(err as Error).stack ?? String(err)}\n`)
  process.exit(1)
})
