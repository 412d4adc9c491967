/**
 * One benchmark server, in its own process: `SETUP=<name> node --import tsx benchmarks/server.ts`
 * (benchmarks/run.ts starts one per measurement). Prints {"port":n} on stdout once listening on
 * 127.0.0.1; SIGTERM closes it (app, store, then the client).
 *
 * Environment: SETUP (one of SETUPS below); for the Postgres setups DATABASE_URL, BENCH_SCHEMA (the
 * schema run.ts migrated: tables `records`, `floor_records`, `payments`) and BENCH_POOL_MAX (10).
 *
 * Every setup answers POST /pay with the same JSON payment (201): ~200 bytes, or ~64 KiB with
 * BENCH_PAYLOAD=65536 (the same payment plus a `padding` field). GET /stats (never protected)
 * returns how many times the operation executed, so run.ts can check that fresh keys each executed
 * once and that replays executed nothing, how many calls reached the store (the round trips a
 * pre-filter saves), and the server-side latency of POST /pay in microseconds (p50/p99/p99.9,
 * onRequest to onResponse, since the last POST /stats/reset). pg-redis and peer-redis also need
 * REDIS_URL. peer-memory and peer-redis are @node-idempotency/core (benchmarks/peer-glue.ts).
 */
import { createHash, randomUUID } from 'node:crypto'
import Fastify, { type FastifyReply, type FastifyRequest } from 'fastify'
import { Redis } from 'ioredis'
import postgres from 'postgres'
import { MemoryStorageAdapter } from '@node-idempotency/storage-adapter-memory'
import { RedisStorageAdapter } from '@node-idempotency/storage-adapter-redis'
import { peerIdempotency } from './peer-glue.js'
import idempotency, { memoryStore, type IdempotencyStore } from '../lib/index.js'
import { postgresStore } from '../drivers/postgres/index.js'
import { redisPrefilter } from '../drivers/redis/index.js'

interface PayBody { amount: number, currency: string }

/** The plugin's defaults, which floor-sql writes too, so both tables hold the same rows. */
const TTL_MS = 86_400_000
const LEASE_MS = 30_000
const SCOPE = 'bench'
const RECORDED_HEADERS = { 'content-type': 'application/json; charset=utf-8' }

let executions = 0
let storeCalls = 0
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
  }
  done()
})

/** The store, with every call that reaches it counted (each is one round trip for Postgres). */
function counted (store: IdempotencyStore): IdempotencyStore {
  const count = <A extends unknown[], R>(call: (...args: A) => Promise<R>) => (...args: A): Promise<R> => { storeCalls++; return call(...args) }
  return {
    ...store,
    claim: count(store.claim),
    complete: count(store.complete),
    release: count(store.release),
    renew: count(store.renew),
    get: count(store.get)
  }
}

/** The peer's storage, with every call that reaches it counted (one round trip each for Redis). */
function countedStorage<S extends { setIfNotExists: (...args: never[]) => Promise<boolean>, set: (...args: never[]) => Promise<void>, get: (...args: never[]) => Promise<string | undefined> }> (storage: S): S {
  for (const name of ['setIfNotExists', 'set', 'get'] as const) {
    const call = (storage[name] as (...args: unknown[]) => Promise<unknown>).bind(storage)
    Object.assign(storage, { [name]: (...args: unknown[]) => { storeCalls++; return call(...args) } })
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

function database (): postgres.Sql {
  const sql = postgres(env('DATABASE_URL'), { max: Number(process.env.BENCH_POOL_MAX ?? '10'), onnotice: () => {} })
  // A timeout: postgres.js 3.4.9's end() may never resolve after a connection died (porsager/postgres#1097).
  closers.push(() => sql.end({ timeout: 2 }))
  return sql
}

/** ~200 bytes of JSON, the same shape in every setup; `id` is padded so its length does not vary. */
function basePayment (id: number | string, body: PayBody): Record<string, unknown> {
  const n = String(id).padStart(12, '0')
  return {
    id: `pay_${n}`,
    object: 'payment',
    status: 'succeeded',
    amount: body.amount,
    currency: body.currency,
    description: `benchmark payment ${n}`,
    livemode: false,
    created: Math.floor(Date.now() / 1000),
    receipt: `rcpt_${n}`
  }
}

/** BENCH_PAYLOAD: the response's JSON size in bytes, 200 (the bare payment) or more (padded). */
const PAYLOAD_BYTES = Number(process.env.BENCH_PAYLOAD ?? '200')
if (!Number.isInteger(PAYLOAD_BYTES) || PAYLOAD_BYTES < 0) throw new Error(`benchmarks/server.ts: BENCH_PAYLOAD=${process.env.BENCH_PAYLOAD}`)
/** Built once: the padding that brings the payment's JSON to PAYLOAD_BYTES (none at 200). */
const PADDING = ((): string | null => {
  const sample = { ...basePayment(0, { amount: 1000, currency: 'EUR' }), padding: '' }
  const missing = PAYLOAD_BYTES - JSON.stringify(sample).length
  return PAYLOAD_BYTES <= 200 || missing <= 0 ? null : 'x'.repeat(missing)
})()

function payment (id: number | string, body: PayBody): object {
  const base = basePayment(id, body)
  if (PADDING !== null) base.padding = PADDING
  return base
}

/** The handler of every setup but pg-atomic and floor-sql: the operation itself costs nothing. */
async function pay (request: FastifyRequest<{ Body: PayBody }>, reply: FastifyReply): Promise<FastifyReply> {
  return reply.code(201).send(payment(++executions, request.body))
}

const SETUPS: Record<string, () => Promise<void>> = {
  async bare () {
    app.post('/pay', pay)
  },

  async memory () {
    // A 64 KiB run records ~11,000 responses (~700 MB): past the default 768 MiB budget, a full
    // store refuses new keys with 503 (by design), which is not what the scenario measures. The
    // peer's memory adapter has no budget at all.
    await app.register(idempotency, { store: memoryStore({ maxBytes: 4 * 1024 ** 3 }), scope: () => SCOPE })
    app.post('/pay', pay)
  },

  async 'pg-lease' () {
    const schema = env('BENCH_SCHEMA')
    const store = postgresStore({ sql: database(), schema, table: 'records' })
    closers.unshift(() => store.close()) // before the client ends
    await app.register(idempotency, { store: counted(store), scope: () => SCOPE })
    app.post('/pay', pay)
  },

  // pg-lease with the Redis pre-filter in front: duplicates answered from Redis never reach Postgres.
  async 'pg-redis' () {
    const schema = env('BENCH_SCHEMA')
    const store = postgresStore({ sql: database(), schema, table: 'records' })
    const redis = new Redis(env('REDIS_URL'), { enableOfflineQueue: true })
    closers.unshift(() => store.close())
    closers.push(async () => { redis.disconnect() })
    await app.register(idempotency, { store: counted(store), prefilter: redisPrefilter({ client: redis, prefix: `bench-${randomUUID()}` }), scope: () => SCOPE })
    app.post('/pay', pay)
  },

  // The peer, @node-idempotency/core 1.0.11, through our glue: its memory adapter.
  async 'peer-memory' () {
    peerIdempotency(app, countedStorage(new MemoryStorageAdapter()))
    app.post('/pay', pay)
  },

  // The peer with its Redis adapter (node-redis 4): the closest peer to pg-redis.
  async 'peer-redis' () {
    const storage = new RedisStorageAdapter({ url: env('REDIS_URL') })
    await storage.connect()
    closers.push(() => storage.disconnect())
    peerIdempotency(app, countedStorage(storage))
    app.post('/pay', pay)
  },

  // The business row commits in the same transaction as the claim and the recorded response.
  async 'pg-atomic' () {
    const schema = env('BENCH_SCHEMA')
    const store = postgresStore({ sql: database(), schema, table: 'records' })
    closers.unshift(() => store.close())
    await app.register(idempotency, { store, scope: () => SCOPE, transaction: true })
    app.post<{ Body: PayBody }>('/pay', async (request, reply) => {
      const tx = request.idempotency?.sql
      if (tx === undefined) throw new Error('pg-atomic: no transaction on the request')
      executions++
      const [row] = await tx`
        INSERT INTO ${tx(schema)}.payments (idempotency_key, amount, currency)
        VALUES (${request.idempotency?.key ?? ''}, ${request.body.amount}, ${request.body.currency})
        RETURNING id`.values()
      return reply.code(201).send(payment(String(row?.[0]), request.body))
    })
  },

  // The floor: what any Postgres-backed implementation must run for a fresh key, by hand and
  // without the plugin. A one-statement claim (INSERT ... ON CONFLICT DO NOTHING RETURNING), the
  // operation, then one UPDATE recording the response, both prepared (postgres.js prepares every
  // statement once per connection), on the same pool size and a table created by the same
  // migrate() as the plugin's. It also stores what the contract needs: a fingerprint (for 422) and
  // an owner token (fencing). A replay is the claim finding the key, then a SELECT of the record.
  async 'floor-sql' () {
    const schema = env('BENCH_SCHEMA')
    const sql = database()
    app.post<{ Body: PayBody }>('/pay', async (request, reply) => {
      const key = request.headers['idempotency-key']
      if (typeof key !== 'string') return reply.code(400).send()
      const fingerprint = createHash('sha256').update(request.method).update(request.url).update(JSON.stringify(request.body)).digest()
      const token = randomUUID()
      const claimed = await sql`
        INSERT INTO ${sql(schema)}.floor_records
          (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, lease_expires_at, expires_at)
        VALUES (${SCOPE}, ${key}, ${fingerprint}, 'sha256', 'in_progress', ${token},
                now() + ${LEASE_MS}::float8 * interval '1 millisecond', now() + ${TTL_MS}::float8 * interval '1 millisecond')
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING true`.values()
      if (claimed.length === 0) return replay(sql, schema, key, fingerprint, reply)

      const body = Buffer.from(JSON.stringify(payment(++executions, request.body)))
      await sql`
        UPDATE ${sql(schema)}.floor_records
        SET state = 'completed', response_status = ${201}, response_headers = ${sql.json(RECORDED_HEADERS)}::jsonb,
            response_body = ${body}, lease_expires_at = NULL, expires_at = now() + ${TTL_MS}::float8 * interval '1 millisecond'
        WHERE scope = ${SCOPE} AND key = ${key} AND owner_token = ${token} AND state = 'in_progress'`
      return reply.code(201).headers(RECORDED_HEADERS).send(body)
    })
  }
}

async function replay (sql: postgres.Sql, schema: string, key: string, fingerprint: Buffer, reply: FastifyReply): Promise<FastifyReply> {
  const [row] = await sql`
    SELECT state, fingerprint, response_status, response_headers, response_body
    FROM ${sql(schema)}.floor_records
    WHERE scope = ${SCOPE} AND key = ${key} AND expires_at > now()`.values()
  if (row === undefined) return reply.code(409).send()
  const [state, digest, status, headers, body] = row as [string, Buffer, number, Record<string, string>, Buffer]
  if (!digest.equals(fingerprint)) return reply.code(422).send()
  if (state !== 'completed') return reply.code(409).send()
  return reply.code(status).headers(headers).header('idempotent-replayed', 'true').send(body)
}

const setup = SETUPS[env('SETUP')]
if (setup === undefined) throw new Error(`benchmarks/server.ts: unknown SETUP ${process.env.SETUP}; one of ${Object.keys(SETUPS).join(', ')}`)
await setup()
// After the setup, which registers the plugin: a POST declared before it would fail the boot.
app.get('/stats', async () => ({
  executions,
  storeCalls,
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
