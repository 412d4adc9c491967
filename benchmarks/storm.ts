/**
 * `npm run bench:storm [-- --quick] [--out FILE]`: duplicates that wait for their original, across
 * instances. Three app instances (in this process, each listening on a port of its own) on one
 * PostgreSQL, each with a client of its own (a pool of 10) and its store, as three processes of
 * one deployment would be; the route has a 1 s handler and a `wait` longer than it. Per mode
 * (lease, atomic):
 *
 * - the storm: the original on instance 0, then, once its handler runs, 200 duplicates at once, spread over the three
 *   instances (autocannon, one request per connection). Checked: the handler ran once and every
 *   duplicate was answered 2xx (its replay). Measured: each waiter's time from the original's
 *   commit (its store's `complete` resolved) to its answer, and the statements it cost (counted on
 *   the wire: the instances' statements over the storm, less the original's own, measured alone
 *   first, and less the other route's);
 * - the pool: a route without idempotency (`SELECT 1` on the same client) loaded on instance 1 by
 *   autocannon for as long as the storm lasts, and alone for as long before: its p99 with and
 *   without the storm, and their ratio.
 *
 * --quick (the test suite's): 30 duplicates of a 300 ms handler, the other route loaded for 300 ms.
 * The figures replace the `storm` section of benchmarks/results/summary.json (summary.quick.json
 * with --quick, or --out).
 */
import { randomBytes } from 'node:crypto'
import { performance } from 'node:perf_hooks'
import autocannon from 'autocannon'
import Fastify, { type FastifyInstance } from 'fastify'
import postgres from 'postgres'
import idempotency, { type IdempotencyStore } from '../lib/index.js'
import { postgresStore, type PostgresStore } from '../drivers/postgres/index.js'
import { countingSocket, emptyCounts, type WireCounts } from './counting.js'
import { benchServices } from './services.js'
import { summaryPath, writeSection, type StormFigures } from './summary-file.js'

const MODES = ['lease', 'atomic'] as const
type Mode = typeof MODES[number]

const args = process.argv.slice(2)
const quick = args.includes('--quick')
const outIndex = args.indexOf('--out')
const OUT = summaryPath(outIndex >= 0 ? args[outIndex + 1] : undefined, quick)
const DUPLICATES = quick ? 30 : 200
const HANDLER_MS = quick ? 300 : 1_000
const WAIT_MS = HANDLER_MS * 5
const INSTANCES = 3
const POOL = 10
/** Connections loading the other route. */
const OTHER_CONNECTIONS = 10

interface Instance {
  readonly app: FastifyInstance
  readonly url: string
  readonly sql: postgres.Sql<any>
  readonly store: PostgresStore
  readonly counts: WireCounts
}

type StormResult = StormFigures & { readonly mode: Mode }

const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms))
const statements = (instances: readonly Instance[]): number => instances.reduce((sum, instance) => sum + instance.counts.statements, 0)

function percentile (sorted: readonly number[], p: number): number {
  if (sorted.length === 0) return Number.NaN
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)] as number
}

/** `runs.count`: the handler's runs; `runs.other`: the other route's (one statement each). */
async function startInstances (url: string, schema: string, table: string, mode: Mode, runs: { count: number, other: number }, committed: { at: number | null }): Promise<Instance[]> {
  const instances: Instance[] = []
  for (let i = 0; i < INSTANCES; i++) {
    const counts = emptyCounts()
    const sql = postgres(url, { max: POOL, fetch_types: false, onnotice: () => {}, socket: countingSocket(counts) } as postgres.Options<{}>)
    const store = postgresStore({ sql, schema, table, purgeInterval: 0 })
    if (i === 0) await store.migrate()
    // The original's commit, as its instance sees it: its `complete` resolved.
    const observed: IdempotencyStore = { ...store, complete: async (lease, response, ttlMs) => { const done = await store.complete(lease, response, ttlMs); committed.at = performance.now(); return done } }
    const app = Fastify()
    await app.register(idempotency, { store: observed, scope: () => 'bench', wait: WAIT_MS, transaction: mode === 'atomic' })
    app.post('/pay', async (request) => {
      runs.count++
      if (mode === 'atomic') await (request.idempotency?.sql as postgres.TransactionSql)`INSERT INTO ${sql(schema)}.payments (key) VALUES (${request.idempotency?.key ?? ''})`
      await sleep(HANDLER_MS)
      return { paid: true }
    })
    app.get('/other', async () => {
      runs.other++
      return (await sql`SELECT 1 AS one`)[0]
    })
    const address = await app.listen({ port: 0, host: '127.0.0.1' })
    instances.push({ app, url: address, sql, store, counts })
  }
  return instances
}

/** One POST with `key` to `instance`, for the original and the warm-ups. */
async function post (instance: Instance, key: string): Promise<number> {
  const response = await fetch(`${instance.url}/pay`, { method: 'POST', headers: { 'content-type': 'application/json', 'idempotency-key': `"${key}"` }, body: '{"amount":1}' })
  await response.arrayBuffer()
  return response.status
}

/** The other route under load for `ms`: its latencies' p99 and requests. */
async function loadOther (instance: Instance, ms: number): Promise<{ p99: number, requests: number }> {
  const result = await autocannon({ url: `${instance.url}/other`, connections: OTHER_CONNECTIONS, duration: ms / 1000 })
  if (result.errors > 0 || result.non2xx > 0) throw new Error(`the other route: ${result.errors} errors, ${result.non2xx} non-2xx`)
  return { p99: result.latency.p99, requests: result.requests.total }
}

/** `count` duplicates of `key` at once on `instance`: when each was answered, and with what status. */
async function duplicates (instance: Instance, key: string, count: number, answers: Array<{ at: number, status: number }>): Promise<void> {
  if (count === 0) return
  const result = await autocannon({
    url: `${instance.url}/pay`,
    method: 'POST',
    connections: count,
    amount: count,
    timeout: (WAIT_MS + 5_000) / 1000,
    headers: { 'content-type': 'application/json', 'idempotency-key': `"${key}"` },
    body: '{"amount":1}',
    setupClient: (client) => { client.on('response', (status: number) => { answers.push({ at: performance.now(), status }) }) }
  })
  if (result.errors > 0 || result.timeouts > 0) throw new Error(`duplicates on ${instance.url}: ${result.errors} errors, ${result.timeouts} timeouts`)
}

async function storm (url: string, schema: string, mode: Mode): Promise<StormResult> {
  const runs = { count: 0, other: 0 }
  const committed: { at: number | null } = { at: null }
  const instances = await startInstances(url, schema, `records_${mode}`, mode, runs, committed)
  try {
    // Every instance serves once (its first claim on a route with `wait` opens its listener), and
    // the other route warms up.
    for (const [i, instance] of instances.entries()) await post(instance, `warm-${i}`)
    await loadOther(instances[1] as Instance, 500)
    await sleep(200)
    // The original's own statements: one alone, as the storm's will be.
    const before = statements(instances)
    await post(instances[0] as Instance, 'alone')
    await sleep(100)
    const originalStatements = statements(instances) - before
    runs.count = 0

    const alone = await loadOther(instances[1] as Instance, HANDLER_MS)
    const answers: Array<{ at: number, status: number }> = []
    committed.at = null
    runs.other = 0
    const start = statements(instances)
    const original = post(instances[0] as Instance, 'storm')
    // The duplicates come once the original has claimed the key (its handler started).
    while (runs.count === 0) await sleep(5)
    const other = loadOther(instances[1] as Instance, HANDLER_MS)
    const share = (i: number): number => Math.floor(DUPLICATES / INSTANCES) + (i < DUPLICATES % INSTANCES ? 1 : 0)
    await Promise.all(instances.map((instance, i) => duplicates(instance, 'storm', share(i), answers)))
    const originalStatus = await original
    const during = await other
    // The notices and settlements still in flight are counted too.
    await sleep(200)
    const stormStatements = statements(instances) - start - originalStatements - runs.other
    if (originalStatus >= 300) throw new Error(`${mode}: the original answered ${originalStatus}`)
    if (runs.count !== 1) throw new Error(`${mode}: the handler ran ${runs.count} times for one key`)
    const statuses: Record<string, number> = {}
    for (const answer of answers) statuses[answer.status] = (statuses[answer.status] ?? 0) + 1
    if (answers.length !== DUPLICATES || answers.some((answer) => answer.status >= 300)) throw new Error(`${mode}: duplicates answered ${JSON.stringify(statuses)}`)
    const commitAt = committed.at as number | null
    if (commitAt === null) throw new Error(`${mode}: the original's commit was not seen`)
    const delays = answers.map((answer) => answer.at - commitAt).sort((a, b) => a - b)
    return {
      mode,
      duplicates: DUPLICATES,
      handlerMs: HANDLER_MS,
      handlerRuns: runs.count,
      statuses,
      commitToAnswer: { p50: round(percentile(delays, 50)), p99: round(percentile(delays, 99)), max: round(delays.at(-1) ?? Number.NaN) },
      statementsPerWaiter: round(stormStatements / DUPLICATES),
      otherRoute: { p99Alone: alone.p99, p99DuringStorm: during.p99, ratio: round(during.p99 / Math.max(1, alone.p99)), requestsDuringStorm: during.requests }
    }
  } finally {
    for (const instance of instances) {
      await instance.app.close()
      await instance.store.close()
      await instance.sql.end({ timeout: 2 })
    }
  }
}

const round = (value: number): number => Math.round(value * 100) / 100

async function main (): Promise<void> {
  const services = await benchServices()
  const admin = postgres(services.databaseUrl, { max: 2, onnotice: () => {} })
  const schema = `bench_storm_${randomBytes(3).toString('hex')}`
  await admin`CREATE SCHEMA ${admin(schema)}`
  await admin`CREATE TABLE ${admin(schema)}.payments (key text NOT NULL)`
  const results: StormResult[] = []
  try {
    for (const mode of MODES) {
      const result = await storm(services.databaseUrl, schema, mode)
      results.push(result)
      process.stdout.write(`${mode}: ${result.duplicates} duplicates over ${INSTANCES} instances of a ${result.handlerMs} ms handler: ` +
        `handler ran ${result.handlerRuns}, every duplicate replayed; commit → answer p50 ${result.commitToAnswer.p50} ms, p99 ${result.commitToAnswer.p99} ms, max ${result.commitToAnswer.max} ms; ` +
        `${result.statementsPerWaiter} statements per waiter; the other route (pool of ${POOL}) p99 ${result.otherRoute.p99Alone} ms alone, ${result.otherRoute.p99DuringStorm} ms during the storm (${result.otherRoute.ratio}×)\n`)
    }
  } finally {
    await admin`DROP SCHEMA ${admin(schema)} CASCADE`.catch(() => {})
    await admin.end({ timeout: 2 })
    await services.stop()
  }
  writeSection(OUT, 'storm', { instances: INSTANCES, pool: POOL, results })
  process.stdout.write(`written to the storm section of ${OUT}\n`)
}

main().then(() => process.exit(0), (err: unknown) => {
  process.stderr.write(`bench:storm failed: ${(err as Error).stack ?? String(err)}\n`)
  process.exit(1)
})
