/**
 * One benchmark server, in its own process: `SETUP=<name> node --import tsx benchmarks/server.ts`
 * (benchmarks/run.ts and benchmarks/crosscheck.ts start one per measurement). Prints {"port":n} on
 * stdout once listening on 127.0.0.1; SIGTERM closes it (app, store, then the client).
 *
 * Environment: SETUP (one of SETUPS below); for the Postgres setups DATABASE_URL, BENCH_SCHEMA (the
 * schema benchmarks/schema.ts created: tables `records`, `floor_records`, `payments`) and
 * BENCH_POOL_MAX (10); pg-redis and peer-redis also need REDIS_URL. BENCH_PAYLOAD: the response's
 * size in bytes (200, or more: the payment padded, benchmarks/route.ts). BENCH_TTL (memory only):
 * records expire after that many ms and are swept every 200 ms, so that the store stops growing
 * (benchmarks/page-faults.ts); without it they are kept for the default day.
 *
 * Every setup answers POST /pay, validated by the same JSON schema (benchmarks/route.ts), with the
 * same JSON payment (201). GET /stats (never protected) returns how many times the operation
 * executed (run.ts checks that fresh keys each executed once and that replays executed nothing),
 * how many POST /pay responses were sent, what reached PostgreSQL and Redis (statements or commands,
 * and round trips, counted on the wire: benchmarks/counting.ts), and the server-side latency of
 * POST /pay in microseconds (p50/p99/p99.9, onRequest to onResponse, since the last POST
 * /stats/reset). Each setup imports only what it uses, so that a server starts fast.
 * peer-memory and peer-redis are @node-idempotency/core (benchmarks/peer-glue.ts).
 */
import { createHash, randomUUID } from 'node:crypto'
import Fastify, { type FastifyReply, type FastifyRequest, type RouteHandlerMethod } from 'fastify'
import type postgres from 'postgres'
import { countingSocket, countRedis, emptyCounts, type WireCounts } from './counting.js'
import { PAY_SCHEMA, padding, payment as paymentOf, type PayBody } from './route.js'

/** The plugin's defaults, which the floors write too, so their table holds the same rows. */
const TTL_MS = 86_400_000
const LEASE_MS = 30_000
const SCOPE = 'bench'
const RECORDED_HEADERS = { 'content-type': 'application/json; charset=utf-8' }

let executions = 0
let requests = 0
/** What reached PostgreSQL / Redis; null for a setup without that backend. */
let pgCounts: WireCounts | null = null
let redisCounts: WireCounts | null = null
const app = Fastify()

/**
 * Server-side latency of POST /pay, in whole microseconds, in a log-linear histogram: exact below
 * 1024 µs, then 128 sub-buckets per power of two (under 1% error), up to 2^31 µs. Fixed size, so
 * recording allocates nothing and the server's RSS does not depend on the request count.
 */
const LINEAR = 1024
const SUB_BITS = 7
const histogram = new Float64Array(LINEAR + (31 - 10) * (1 << SUB_BITS))
let samples = 0
function bucketOf (us: number): number {
  if (us < LINEAR) return us
  const exponent = Math.min(30, 31 - Math.clz32(us)) // floor(log2(us)), ≥ 10
  return LINEAR + (exponent - 10) * (1 << SUB_BITS) + ((us >>> (exponent - SUB_BITS)) & ((1 << SUB_BITS) - 1))
}
/** The bucket's lower bound, in µs. */
function valueOf (bucket: number): number {
  if (bucket < LINEAR) return bucket
  const exponent = 10 + Math.floor((bucket - LINEAR) / (1 << SUB_BITS))
  const sub = (bucket - LINEAR) % (1 << SUB_BITS)
  return ((1 << SUB_BITS) + sub) * 2 ** (exponent - SUB_BITS)
}
function percentile (q: number): number | null {
  if (samples === 0) return null
  const rank = Math.ceil(q * samples)
  let seen = 0
  for (let i = 0; i < histogram.length; i++) {
    seen += histogram[i]!
    if (seen >= rank) return valueOf(i)
  }
  return null
}
// Added first, before any plugin, so that they bracket the whole lifecycle (the plugins' hooks too).
const startedAt = Symbol('startedAt')
type Timed = FastifyRequest & { [startedAt]?: bigint }
app.addHook('onRequest', (request, _reply, done) => { (request as Timed)[startedAt] = process.hrtime.bigint(); done() })
app.addHook('onResponse', (request, _reply, done) => {
  const start = (request as Timed)[startedAt]
  if (start !== undefined && request.url === '/pay') {
    histogram[bucketOf(Math.min(2 ** 31 - 1, Number((process.hrtime.bigint() - start) / 1000n)))]!++
    samples++
    requests++
  }
  done()
})

/**
 * The peer's storage, with every call counted as one Redis command and one round trip: its Redis
 * adapter (node-redis) sends exactly one command per call (SET NX PX, SET PX, GET) and awaits it.
 */
function countedStorage<S extends { setIfNotExists: (...args: never[]) => Promise<boolean>, set: (...args: never[]) => Promise<void>, get: (...args: never[]) => Promise<string | undefined> }> (storage: S, counts: WireCounts): S {
  for (const name of ['setIfNotExists', 'set', 'get'] as const) {
    const call = (storage[name] as (...args: unknown[]) => Promise<unknown>).bind(storage)
    Object.assign(storage, { [name]: (...args: unknown[]) => { counts.statements++; counts.roundTrips++; return call(...args) } })
  }
  return storage
}

/** Run at SIGTERM after app.close(), in order. */
const closers: Array<() => Promise<unknown>> = []

function env (name: string): string {
  const value = process.env[name]
  if (value === undefined || value === '') throw new Error(`benchmarks/server.ts: ${name} is not set`)
  return value
}

/** pg-lease behind the Redis pre-filter, its commands pipelined per event-loop turn or not. */
async function prefiltered (pipeline: boolean): Promise<void> {
  const { default: idempotency } = await plugin()
  const { postgresStore } = await import('../drivers/postgres/index.js')
  const { redisPrefilter } = await import('../drivers/redis/index.js')
  const { Redis } = await import('ioredis')
  const store = postgresStore({ sql: await database(), schema: env('BENCH_SCHEMA'), table: 'records' })
  const redis = new Redis(env('REDIS_URL'), { enableOfflineQueue: true })
  countRedis(redis, redisCounts = emptyCounts())
  closers.unshift(() => store.close())
  closers.push(async () => { redis.disconnect() })
  await app.register(idempotency, { store, prefilter: redisPrefilter({ client: redis, prefix: `bench-${randomUUID()}`, pipeline }), scope: () => SCOPE })
  route(pay)
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

/** BENCH_PAYLOAD: the response's JSON size in bytes, 200 (the bare payment) or more (padded). */
const PAYLOAD_BYTES = Number(process.env.BENCH_PAYLOAD ?? '200')
if (!Number.isInteger(PAYLOAD_BYTES) || PAYLOAD_BYTES < 0) throw new Error(`benchmarks/server.ts: BENCH_PAYLOAD=${process.env.BENCH_PAYLOAD}`)
/** Built once: none at 200. */
const PADDING = padding(PAYLOAD_BYTES)

const payment = (id: number | string, body: PayBody): Record<string, unknown> => paymentOf(id, body, PADDING)

/** POST /pay, with its schema: every setup declares its route through this. */
function route (handler: RouteHandlerMethod): void {
  app.post('/pay', { schema: PAY_SCHEMA }, handler)
}

/** The handler of every setup but pg-atomic and the floors: the operation itself costs nothing. */
async function pay (request: FastifyRequest, reply: FastifyReply): Promise<FastifyReply> {
  return reply.code(201).send(payment(++executions, request.body as PayBody))
}

async function plugin (): Promise<typeof import('../lib/index.js')> {
  return await import('../lib/index.js')
}

const SETUPS: Record<string, () => Promise<void>> = {
  async bare () {
    route(pay)
  },

  async memory () {
    const { default: idempotency, memoryStore } = await plugin()
    // A 1 MiB run records a few thousand responses (GBs): past the default 768 MiB budget, a full
    // store refuses new keys with 503 (by design), which is not what the scenario measures. The
    // peer's memory adapter has no budget at all.
    const ttl = process.env.BENCH_TTL === undefined ? {} : { ttl: Number(process.env.BENCH_TTL) }
    const sweep = process.env.BENCH_TTL === undefined ? {} : { purgeInterval: 200 }
    await app.register(idempotency, { store: memoryStore({ maxBytes: 16 * 1024 ** 3, ...sweep }), scope: () => SCOPE, ...ttl })
    route(pay)
  },

  async 'pg-lease' () {
    const { default: idempotency } = await plugin()
    const { postgresStore } = await import('../drivers/postgres/index.js')
    const store = postgresStore({ sql: await database(), schema: env('BENCH_SCHEMA'), table: 'records' })
    closers.unshift(() => store.close()) // before the client ends
    await app.register(idempotency, { store, scope: () => SCOPE })
    route(pay)
  },

  // pg-lease with the Redis pre-filter in front: duplicates answered from Redis never reach Postgres.
  'pg-redis': async () => { await prefiltered(true) },

  // The same with the pre-filter's `pipeline: false`: each Redis command in a write of its own.
  'pg-redis-unpipelined': async () => { await prefiltered(false) },

  // The peer, @node-idempotency/core 1.0.11, through our glue: its memory adapter.
  async 'peer-memory' () {
    const { peerIdempotency } = await import('./peer-glue.js')
    const { MemoryStorageAdapter } = await import('@node-idempotency/storage-adapter-memory')
    peerIdempotency(app, new MemoryStorageAdapter())
    route(pay)
  },

  // The peer with its Redis adapter (node-redis 4): the closest peer to pg-redis.
  async 'peer-redis' () {
    const { peerIdempotency } = await import('./peer-glue.js')
    const { RedisStorageAdapter } = await import('@node-idempotency/storage-adapter-redis')
    const storage = new RedisStorageAdapter({ url: env('REDIS_URL') })
    await storage.connect()
    closers.push(() => storage.disconnect())
    peerIdempotency(app, countedStorage(storage, redisCounts = emptyCounts()))
    route(pay)
  },

  // The business row commits in the same transaction as the claim and the recorded response.
  async 'pg-atomic' () {
    const { default: idempotency } = await plugin()
    const { postgresStore } = await import('../drivers/postgres/index.js')
    const schema = env('BENCH_SCHEMA')
    const store = postgresStore({ sql: await database(), schema, table: 'records' })
    closers.unshift(() => store.close())
    await app.register(idempotency, { store, scope: () => SCOPE, transaction: true })
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

  // The floors: what any Postgres-backed implementation must run, by hand and without the plugin,
  // on the same pool, the same table (the driver's migrate(): benchmarks/schema.ts) and prepared
  // statements (postgres.js prepares every statement once per connection). They store what the
  // contract needs: a fingerprint (for 422) and an owner token (fencing).

  // A fresh key: the claim (INSERT … ON CONFLICT DO NOTHING RETURNING), the operation, the UPDATE
  // recording the response; 2 statements in autocommit. A key already there: a SELECT of it.
  async 'floor-sql' () {
    const sql = await database()
    const floor = floorStatements(sql, env('BENCH_SCHEMA'))
    route(async (request, reply) => {
      const key = keyOf(request)
      if (key === null) return reply.code(400).send()
      const fingerprint = fingerprintOf(request)
      if (!await floor.fresh(key, fingerprint, request.body as PayBody, reply)) await floor.replay(key, fingerprint, reply)
      return reply
    })
  },

  // The replay floor: ONE primary-key SELECT returning the stored body answers a completed key. A
  // key not there yet then takes floor-sql's fresh path (so 3 statements for a fresh key: this is
  // the floor of replays only).
  async 'floor-select' () {
    const sql = await database()
    const floor = floorStatements(sql, env('BENCH_SCHEMA'))
    route(async (request, reply) => {
      const key = keyOf(request)
      if (key === null) return reply.code(400).send()
      const fingerprint = fingerprintOf(request)
      const answered = await floor.replay(key, fingerprint, reply, true) ||
        await floor.fresh(key, fingerprint, request.body as PayBody, reply)
      if (!answered) await floor.replay(key, fingerprint, reply)
      return reply
    })
  },

  // The atomic floor: BEGIN, the claim INSERT, the same business INSERT as pg-atomic's, the UPDATE
  // recording the response, COMMIT, in one transaction (5 statements, 5 round trips). A key
  // already there: the claim waits for its transaction, inserts nothing, and a SELECT answers it.
  async 'floor-txn' () {
    const sql = await database()
    const schema = env('BENCH_SCHEMA')
    const floor = floorStatements(sql, schema)
    route(async (request, reply) => {
      const key = keyOf(request)
      if (key === null) return reply.code(400).send()
      const fingerprint = fingerprintOf(request)
      const body = request.body as PayBody
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
      return reply
    })
  }
}

/** The key's value: the sf-string without its quotes (the minimum parse; the plugin does RFC 8941). */
function keyOf (request: FastifyRequest): string | null {
  const raw = request.headers['idempotency-key']
  if (typeof raw !== 'string' || raw.length === 0) return null
  return raw.length >= 2 && raw.startsWith('"') && raw.endsWith('"') ? raw.slice(1, -1) : raw
}

function fingerprintOf (request: FastifyRequest): Buffer {
  return createHash('sha256').update(request.method).update(request.url).update(JSON.stringify(request.body)).digest()
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

/**
 * The floors' statements, shared so that each floor runs exactly the same text. Each sends its
 * answer and resolves to whether it did: never to the reply, a thenable that would make the
 * caller's await wait for the response to be written (and read as undefined).
 */
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

    /**
     * Answers a key from its record with one primary-key SELECT: the replay, 422 or 409. A key with
     * no live record: 409 (it was claimed a moment ago, or is being reclaimed), or false with
     * `missingIsFalse` (nothing sent: the caller goes on to claim it).
     */
    async replay (key: string, fingerprint: Buffer, reply: FastifyReply, missingIsFalse = false): Promise<boolean> {
      const [row] = await sql`
        SELECT state, fingerprint, response_status, response_headers, response_body
        FROM ${sql(schema)}.floor_records
        WHERE scope = ${SCOPE} AND key = ${key} AND expires_at > now()`.values()
      if (row === undefined && missingIsFalse) return false
      const [state, digest, status, headers, body] = (row ?? []) as [string?, Buffer?, number?, Record<string, string>?, Buffer?]
      if (row === undefined) void reply.code(409).send()
      else if (!digest!.equals(fingerprint)) void reply.code(422).send()
      else if (state !== 'completed') void reply.code(409).send()
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
  latencyUs: { samples, p50: percentile(0.5), p99: percentile(0.99), p99_9: percentile(0.999) }
}))
app.post('/stats/reset', { config: { idempotency: false } }, async () => { histogram.fill(0); samples = 0; return { ok: true } })
await app.listen({ host: '127.0.0.1', port: 0 })
const address = app.server.address()
process.stdout.write(JSON.stringify({ port: typeof address === 'object' && address !== null ? address.port : 0 }) + '\n')

process.once('SIGTERM', () => {
  app.close()
    .then(async () => { for (const close of closers) await close() })
    .then(() => process.exit(0), (err: unknown) => { console.error(err); process.exit(1) })
})
