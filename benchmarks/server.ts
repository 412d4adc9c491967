/**
 * One benchmark server: `SETUP=<name> node --import tsx benchmarks/server.ts` (run.ts starts one per
 * measurement). Prints {"port":n} once listening on 127.0.0.1; SIGTERM closes it.
 *
 * Environment: SETUP (one of SETUPS below); for PostgreSQL DATABASE_URL, BENCH_SCHEMA (run.ts's
 * tables) and BENCH_POOL_MAX; for Redis REDIS_URL; BENCH_PAYLOAD, the response's size in bytes.
 * Every setup answers POST /pay with the same schema and payment (route.ts). GET /stats returns the
 * handler's executions, the responses sent, what reached PostgreSQL and Redis (counting.ts), the
 * server's own latency of POST /pay in µs (onRequest to onResponse, since POST /stats/reset) and
 * the CPU time the server process has used.
 */
import { createHash, randomUUID } from 'node:crypto'
import { createHistogram } from 'node:perf_hooks'
import Fastify, { type FastifyReply, type FastifyRequest, type RouteHandlerMethod } from 'fastify'
import type postgres from 'postgres'
import { countingSocket, countRedis, emptyCounts, type WireCounts } from './counting.js'
import { PAY_SCHEMA, padding, payment as paymentOf, type PayBody } from './route.js'

/** The plugin's defaults, which the floors write too, so that their table holds the same rows. */
const TTL_MS = 86_400_000
const LEASE_MS = 30_000
const SCOPE = 'bench'
const RECORDED_HEADERS = { 'content-type': 'application/json; charset=utf-8' }
const PADDING = padding(Number(process.env.BENCH_PAYLOAD ?? '200'))
const payment = (id: number | string, body: PayBody): Record<string, unknown> => paymentOf(id, body, PADDING)

let executions = 0
let requests = 0
/** What reached PostgreSQL / Redis; null for a setup without that backend. */
let pgCounts: WireCounts | null = null
let redisCounts: WireCounts | null = null
/** Run at SIGTERM after app.close(), in order. */
const closers: Array<() => Promise<unknown>> = []
const app = Fastify()

/** Node's HDR histogram (2 significant figures): fixed size, so recording allocates nothing. */
const latency = createHistogram({ lowest: 1, highest: 2 ** 31, figures: 2 })
// Added first, before any plugin, so that they bracket the whole lifecycle (the plugins' hooks too).
const startedAt = Symbol('startedAt')
type Timed = FastifyRequest & { [startedAt]?: bigint }
app.addHook('onRequest', (request, _reply, done) => { (request as Timed)[startedAt] = process.hrtime.bigint(); done() })
app.addHook('onResponse', (request, _reply, done) => {
  const start = (request as Timed)[startedAt]
  if (start !== undefined && request.url === '/pay') {
    latency.record(Math.max(1, Number((process.hrtime.bigint() - start) / 1000n)))
    requests++
  }
  done()
})

/** CPU time of this process so far (user and system), in µs: what the server spends, apart from its backends. */
function serverCpuUs (): number {
  const { user, system } = process.cpuUsage()
  return user + system
}

function env (name: string): string {
  const value = process.env[name]
  if (value === undefined || value === '') throw new Error(`benchmarks/server.ts: ${name} is not set`)
  return value
}

/** The pool every Postgres setup uses (same size, same client), its wire counted. */
async function database (): Promise<postgres.Sql> {
  const { default: postgres } = await import('postgres')
  pgCounts = emptyCounts()
  // `socket` is postgres.js's hook for a socket of one's own; its type declarations omit it.
  const options = { max: Number(process.env.BENCH_POOL_MAX ?? '10'), onnotice: () => {}, socket: countingSocket(pgCounts) }
  const sql = postgres(env('DATABASE_URL'), options as postgres.Options<{}>)
  // A timeout: postgres.js 3.4.9's end() may never resolve after a connection died (porsager/postgres#1097).
  closers.push(() => sql.end({ timeout: 2 }))
  return sql
}

/** POST /pay, with its schema: every setup declares its route through this. */
function route (handler: RouteHandlerMethod): void {
  app.post('/pay', { schema: PAY_SCHEMA }, handler)
}

/** The handler of every setup but pg-atomic and the floors: the operation itself costs nothing. */
async function pay (request: FastifyRequest, reply: FastifyReply): Promise<FastifyReply> {
  return reply.code(201).send(payment(++executions, request.body as PayBody))
}

/** The plugin on the PostgreSQL store, lease or atomic mode, with or without the Redis pre-filter. */
async function postgresPlugin ({ transaction = false, pipeline }: { transaction?: boolean, pipeline?: boolean }): Promise<void> {
  const { default: idempotency } = await import('../lib/index.js')
  const { postgresStore } = await import('../drivers/postgres/index.js')
  const store = postgresStore({ sql: await database(), schema: env('BENCH_SCHEMA'), table: 'records' })
  closers.unshift(() => store.close()) // before the client ends
  let prefilter
  if (pipeline !== undefined) {
    const { redisPrefilter } = await import('../drivers/redis/index.js')
    const { Redis } = await import('ioredis')
    const redis = new Redis(env('REDIS_URL'), { enableOfflineQueue: true })
    countRedis(redis, redisCounts = emptyCounts())
    closers.push(async () => { redis.disconnect() })
    prefilter = redisPrefilter({ client: redis, prefix: `bench-${randomUUID()}`, pipeline })
  }
  await app.register(idempotency, { store, scope: () => SCOPE, transaction, ...(prefilter === undefined ? {} : { prefilter }) })
}

/** The peer's storage, each call counted as one Redis command and round trip (its adapter sends one command per call). */
function countedStorage<S extends object> (storage: S, counts: WireCounts): S {
  for (const name of ['setIfNotExists', 'set', 'get'] as const) {
    const call = (storage as Record<string, (...args: unknown[]) => Promise<unknown>>)[name]!.bind(storage)
    Object.assign(storage, { [name]: (...args: unknown[]) => { counts.statements++; counts.roundTrips++; return call(...args) } })
  }
  return storage
}

const SETUPS: Record<string, () => Promise<void>> = {
  async bare () { route(pay) },

  async memory () {
    // A 1 MiB run records GBs of responses: past the default budget a full store answers 503 (by
    // design), which is not what the scenario measures. The peer's memory adapter has no budget.
    const { default: idempotency, memoryStore } = await import('../lib/index.js') // each setup imports only what it uses
    await app.register(idempotency, { store: memoryStore({ maxBytes: 16 * 1024 ** 3 }), scope: () => SCOPE })
    route(pay)
  },

  async 'pg-lease' () { await postgresPlugin({}); route(pay) },
  async 'pg-redis' () { await postgresPlugin({ pipeline: true }); route(pay) },
  // Each Redis command in a write of its own.
  async 'pg-redis-unpipelined' () { await postgresPlugin({ pipeline: false }); route(pay) },

  // The business row commits in the same transaction as the claim and the recorded response.
  async 'pg-atomic' () {
    await postgresPlugin({ transaction: true })
    const schema = env('BENCH_SCHEMA')
    route(async (request, reply) => {
      const body = request.body as PayBody
      const tx = request.idempotency?.sql
      if (tx === undefined) throw new Error('pg-atomic: no transaction on the request')
      executions++
      const [row] = await tx`
        INSERT INTO ${tx(schema)}.payments (idempotency_key, amount, currency)
        VALUES (${request.idempotency?.key ?? ''}, ${body.amount}, ${body.currency})
        RETURNING id`.values()
      return reply.code(201).send(payment(String(row?.[0]), body))
    })
  },

  async 'peer-memory' () {
    const { peerIdempotency } = await import('./peer-glue.js')
    const { MemoryStorageAdapter } = await import('@node-idempotency/storage-adapter-memory')
    peerIdempotency(app, new MemoryStorageAdapter())
    route(pay)
  },

  async 'peer-redis' () {
    const { peerIdempotency } = await import('./peer-glue.js')
    const { RedisStorageAdapter } = await import('@node-idempotency/storage-adapter-redis')
    const storage = new RedisStorageAdapter({ url: env('REDIS_URL') })
    await storage.connect()
    closers.push(() => storage.disconnect())
    peerIdempotency(app, countedStorage(storage, redisCounts = emptyCounts()))
    route(pay)
  },

  // The floors: what any Postgres-backed implementation must run, by hand, on the same pool, the
  // same table (the driver's migrate()) and prepared statements, storing what the contract needs:
  // a fingerprint (for 422) and an owner token (fencing).

  // A fresh key: the claim and the UPDATE recording the response, 2 statements in autocommit.
  async 'floor-sql' () {
    const floor = floorStatements(await database(), env('BENCH_SCHEMA'))
    floorRoute(async (key, fingerprint, body, reply) => {
      if (!await floor.fresh(key, fingerprint, body, reply)) await floor.replay(key, fingerprint, reply)
    })
  },

  // A completed key: ONE primary-key SELECT returning the stored body (a new key then takes
  // floor-sql's path: this is the floor of replays only).
  async 'floor-select' () {
    const floor = floorStatements(await database(), env('BENCH_SCHEMA'))
    floorRoute(async (key, fingerprint, body, reply) => {
      if (!(await floor.replay(key, fingerprint, reply, true) || await floor.fresh(key, fingerprint, body, reply))) await floor.replay(key, fingerprint, reply)
    })
  },

  // BEGIN, the claim, the same business INSERT as pg-atomic's, the UPDATE, COMMIT: 5 statements,
  // 5 round trips. A key already there: the claim waits for its transaction, then a SELECT answers.
  async 'floor-txn' () {
    const sql = await database()
    const schema = env('BENCH_SCHEMA')
    const floor = floorStatements(sql, schema)
    floorRoute(async (key, fingerprint, body, reply) => {
      const token = randomUUID()
      const recorded = await sql.begin(async (tx) => {
        if (!await floorClaim(tx, schema, key, fingerprint, token)) return null
        const [row] = await tx`
          INSERT INTO ${tx(schema)}.payments (idempotency_key, amount, currency)
          VALUES (${key}, ${body.amount}, ${body.currency})
          RETURNING id`.values()
        executions++
        const response = Buffer.from(JSON.stringify(payment(String(row?.[0]), body)))
        await floorComplete(tx, schema, key, token, response)
        return response
      })
      if (recorded === null) await floor.replay(key, fingerprint, reply)
      else void reply.code(201).headers(RECORDED_HEADERS).send(recorded)
    })
  }
}

/**
 * A floor's POST /pay: the key (the sf-string without its quotes: the minimum parse, where the
 * plugin does RFC 8941) and a SHA-256 fingerprint of method, URL and body, then `handle`, which
 * sends the answer. It never resolves to the reply, a thenable that would make an await wait for
 * the response to be written.
 */
function floorRoute (handle: (key: string, fingerprint: Buffer, body: PayBody, reply: FastifyReply) => Promise<void>): void {
  route(async (request, reply) => {
    const raw = request.headers['idempotency-key']
    if (typeof raw !== 'string' || raw.length < 3) return reply.code(400).send()
    const fingerprint = createHash('sha256').update(request.method).update(request.url).update(JSON.stringify(request.body)).digest()
    await handle(raw.slice(1, -1), fingerprint, request.body as PayBody, reply)
    return reply
  })
}

/** The floors' claim: one INSERT … ON CONFLICT DO NOTHING, in autocommit or in `handle`'s transaction. True when it claimed. */
async function floorClaim (handle: postgres.Sql | postgres.TransactionSql, schema: string, key: string, fingerprint: Buffer, token: string): Promise<boolean> {
  const claimed = await handle`
    INSERT INTO ${handle(schema)}.floor_records
      (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, lease_expires_at, expires_at)
    VALUES (${SCOPE}, ${key}, ${fingerprint}, 'sha256', 'in_progress', ${token},
            now() + ${LEASE_MS}::float8 * interval '1 millisecond', now() + ${TTL_MS}::float8 * interval '1 millisecond')
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING true`.values()
  return claimed.length > 0
}

/** The floors' completing UPDATE, fenced by the owner token as the plugin's is. */
async function floorComplete (handle: postgres.Sql | postgres.TransactionSql, schema: string, key: string, token: string, body: Buffer): Promise<void> {
  await handle`
    UPDATE ${handle(schema)}.floor_records
    SET state = 'completed', response_status = ${201}, response_headers = ${handle.json(RECORDED_HEADERS)}::jsonb,
        response_body = ${body}, lease_expires_at = NULL, expires_at = now() + ${TTL_MS}::float8 * interval '1 millisecond'
    WHERE scope = ${SCOPE} AND key = ${key} AND owner_token = ${token} AND state = 'in_progress'`
}

/** The floors' statements, shared so that each floor runs exactly the same text; each resolves to whether it answered. */
function floorStatements (sql: postgres.Sql, schema: string) {
  return {
    /** Claims and runs a fresh key (2 statements); false when the key is already there. */
    async fresh (key: string, fingerprint: Buffer, request: PayBody, reply: FastifyReply): Promise<boolean> {
      const token = randomUUID()
      if (!await floorClaim(sql, schema, key, fingerprint, token)) return false
      const body = Buffer.from(JSON.stringify(payment(++executions, request)))
      await floorComplete(sql, schema, key, token, body)
      void reply.code(201).headers(RECORDED_HEADERS).send(body)
      return true
    },

    /** One primary-key SELECT answers the key: the replay, 422 or 409; no live record: 409, or false with `missingIsFalse`. */
    async replay (key: string, fingerprint: Buffer, reply: FastifyReply, missingIsFalse = false): Promise<boolean> {
      const [row] = await sql`
        SELECT state, fingerprint, response_status, response_headers, response_body
        FROM ${sql(schema)}.floor_records
        WHERE scope = ${SCOPE} AND key = ${key} AND expires_at > now()`.values()
      if (row === undefined && missingIsFalse) return false
      const [state, digest, status, headers, body] = (row ?? []) as [string?, Buffer?, number?, Record<string, string>?, Buffer?]
      if (row === undefined || state !== 'completed') void reply.code(409).send()
      else if (!digest!.equals(fingerprint)) void reply.code(422).send()
      else void reply.code(status!).headers(headers!).header('idempotent-replayed', 'true').send(body)
      return true
    }
  }
}

const setup = SETUPS[env('SETUP')]
if (setup === undefined) throw new Error(`benchmarks/server.ts: unknown SETUP ${process.env.SETUP}; one of ${Object.keys(SETUPS).join(', ')}`)
await setup()
// After the setup, which registers the plugin: a POST declared before it would fail the boot.
app.get('/stats', async () => ({
  executions,
  requests,
  pg: pgCounts,
  redis: redisCounts,
  latencyUs: { samples: latency.count, p50: latency.percentile(50), p99: latency.percentile(99), p99_9: latency.percentile(99.9) },
  cpuUs: serverCpuUs()
}))
app.post('/stats/reset', { config: { idempotency: false } }, async () => { latency.reset(); return { ok: true } })
await app.listen({ host: '127.0.0.1', port: 0 })
const address = app.server.address()
process.stdout.write(JSON.stringify({ port: typeof address === 'object' && address !== null ? address.port : 0 }) + '\n')

process.once('SIGTERM', () => {
  app.close()
    .then(async () => { for (const close of closers) await close() })
    .then(() => process.exit(0), (err: unknown) => { console.error(err); process.exit(1) })
})
