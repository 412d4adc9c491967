/**
 * One instance of the chaos harness's payments API: a Fastify app using the plugin with the shared
 * Postgres store and a Redis pre-filter (standalone or cluster). Several run side by side on
 * loopback; the harness kills, restarts and skews them.
 *
 *   POST /payments/atomic  atomic mode: the effect is a ledger row written through the claim's
 *                          transaction (request.idempotency.sql)
 *   POST /payments/lease   lease mode: the effect is a charge at the fake provider, made with a key
 *                          derived from (scope, key), so a re-run after a takeover replays it
 *   GET  /health           { instance, now }: `now` is the instance's (possibly skewed) clock
 *
 * Both answer 201 { mode, scope, key, amount, ref }: the scope is the account header's, so the
 * checker can see an answer that crossed scopes.
 *
 * Run as `node --import tsx --import ./test/chaos/clock-skew.ts test/chaos/app.ts` with an IPC
 * channel; configured by CHAOS_* variables (see settingsFromEnv). Sends `{ type: 'ready' }` once
 * listening; `{ type: 'shutdown' }` closes it gracefully; it exits when the channel closes.
 */
import { randomUUID } from 'node:crypto'
import Fastify, { type FastifyRequest } from 'fastify'
import { Cluster, Redis } from 'ioredis'
import postgres from 'postgres'
import idempotency, { type IdempotencyContext } from '../../lib/index.js'
import { postgresStore } from '../../drivers/postgres/index.js'
import { redisPrefilter } from '../../drivers/redis/index.js'
import { providerKeyFor } from './derive.js'
import { post } from './http.js'

interface Settings {
  readonly instance: number
  readonly port: number
  readonly databaseUrl: string
  /** `standalone:redis://host:port` or `cluster:host:port,host:port,...` */
  readonly redis: string
  readonly providerPort: number
  readonly leaseMs: number
  readonly waitMs: number
  readonly storeTimeoutMs: number
  readonly providerTimeoutMs: number
  /** Upper bound of a random pause inside each handler, after its effect: widens the crash windows. */
  readonly handlerDelayMs: number
}

function settingsFromEnv (env: NodeJS.ProcessEnv): Settings {
  const need = (name: string): string => {
    const value = env[name]
    if (value === undefined || value === '') throw new Error(`chaos app: ${name} is required`)
    return value
  }
  return {
    instance: Number(need('CHAOS_INSTANCE')),
    port: Number(need('CHAOS_PORT')),
    databaseUrl: need('CHAOS_DATABASE_URL'),
    redis: need('CHAOS_REDIS'),
    providerPort: Number(need('CHAOS_PROVIDER_PORT')),
    leaseMs: Number(env.CHAOS_LEASE_MS ?? '3000'),
    waitMs: Number(env.CHAOS_WAIT_MS ?? '250'),
    storeTimeoutMs: Number(env.CHAOS_STORE_TIMEOUT_MS ?? '2000'),
    providerTimeoutMs: Number(env.CHAOS_PROVIDER_TIMEOUT_MS ?? '1500'),
    handlerDelayMs: Number(env.CHAOS_HANDLER_DELAY_MS ?? '30')
  }
}

/** A step API, when the plugin has one (request.idempotency.step): the charge is then a recovery point. */
type WithRecovery = IdempotencyContext & {
  deriveKey?: (name: string) => string
  step?: <T>(name: string, fn: () => Promise<T>) => Promise<T>
}

const settings = settingsFromEnv(process.env)
const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms))

const sql = postgres(settings.databaseUrl, {
  max: 12,
  connect_timeout: 3,
  onnotice: () => {},
  // postgres.js 3.4.9 fetches array types as the first query of every connection and drops that
  // promise: a connection reset meanwhile is an unhandled rejection that kills the process
  // (porsager/postgres#1192). The plugin binds no arrays, so nothing is lost by not fetching.
  fetch_types: false,
  // synchronous_commit on for this session: a COMMIT the app saw succeed survives a server crash
  // (the throwaway server runs with it off). application_name lets the harness terminate exactly
  // the apps' backends.
  connection: { application_name: `chaos-app-${settings.instance}`, synchronous_commit: 'on' }
})

function redisClient (): Redis | Cluster {
  // No offline queue and no per-command retries: a Redis outage must fail fast so the pre-filter
  // falls through to the store (lib/prefilter.ts: Redis never decides).
  if (settings.redis.startsWith('cluster:')) {
    const nodes = settings.redis.slice('cluster:'.length).split(',').map((address) => {
      const [host = '127.0.0.1', port = '0'] = address.split(':')
      return { host, port: Number(port) }
    })
    return new Cluster(nodes, {
      enableOfflineQueue: false,
      clusterRetryStrategy: () => 200,
      redisOptions: { maxRetriesPerRequest: 0, connectTimeout: 1000 }
    })
  }
  return new Redis(settings.redis.slice('standalone:'.length), {
    enableOfflineQueue: false,
    maxRetriesPerRequest: 0,
    connectTimeout: 1000,
    retryStrategy: () => 200
  })
}

const redis = redisClient()
redis.on('error', () => {})
const store = postgresStore({ sql, purgeInterval: 0 })
const app = Fastify({ logger: { level: process.env.CHAOS_LOG_LEVEL ?? 'silent' } })

// Authentication stand-in: the account header is the principal (draft §5: keys are scoped to it).
app.addHook('onRequest', async (request, reply) => {
  if (request.method === 'POST' && typeof request.headers['x-account'] !== 'string') {
    return reply.code(401).send({ error: 'x-account required' })
  }
})

await app.register(idempotency, {
  store,
  prefilter: redisPrefilter({ client: redis, prefix: 'chaos', timeout: 50 }),
  scope: (request: FastifyRequest) => request.headers['x-account'] as string,
  required: true,
  lease: settings.leaseMs,
  wait: settings.waitMs,
  storeTimeout: settings.storeTimeoutMs,
  retryAfter: 1
})

interface PaymentRequest { amount: number, currency: string }
const bodySchema = {
  type: 'object',
  required: ['amount', 'currency'],
  additionalProperties: false,
  properties: { amount: { type: 'integer', minimum: 1 }, currency: { type: 'string', minLength: 3, maxLength: 3 } }
} as const

app.post<{ Body: PaymentRequest }>('/payments/atomic', {
  schema: { body: bodySchema },
  config: { idempotency: { transaction: true } }
}, async (request, reply) => {
  const idem = request.idempotency
  const tx = idem?.sql
  if (idem === null || tx === undefined) throw new Error('not in atomic mode')
  const ref = randomUUID()
  await tx`INSERT INTO ledger (id, scope, key, amount) VALUES (${ref}, ${idem.scope}, ${idem.key}, ${request.body.amount})`
  await sleep(Math.random() * settings.handlerDelayMs)
  return reply.code(201).send({ mode: 'atomic', scope: idem.scope, key: idem.key, amount: request.body.amount, ref })
})

app.post<{ Body: PaymentRequest }>('/payments/lease', { schema: { body: bodySchema } }, async (request, reply) => {
  const idem = request.idempotency as WithRecovery | null
  if (idem === null) throw new Error('not protected')
  const providerKey = process.env.CHAOS_PLANT === 'provider-key-per-attempt'
    ? randomUUID() // the planted bug (run.ts --plant): a key per attempt, so a re-run charges again
    : typeof idem.deriveKey === 'function' ? idem.deriveKey('charge') : providerKeyFor(idem.scope, idem.key, 'charge')
  const call = (): Promise<{ id: string }> => chargeAtProvider(providerKey, idem.scope, idem.key, request.body)
  const charge = typeof idem.step === 'function' ? await idem.step('charge', call) : await call()
  await sleep(Math.random() * settings.handlerDelayMs)
  return reply.code(201).send({ mode: 'lease', scope: idem.scope, key: idem.key, amount: request.body.amount, ref: charge.id })
})

app.get('/health', async () => ({ instance: settings.instance, now: Date.now() }))

/** Any failure (a timeout, a reset, a non-201) throws: the plugin releases the key and the client retries. */
async function chargeAtProvider (providerKey: string, scope: string, key: string, body: PaymentRequest): Promise<{ id: string }> {
  const result = await post(settings.providerPort, '/charges', {
    'content-type': 'application/json',
    'idempotency-key': providerKey
  }, JSON.stringify({ amount: body.amount, currency: body.currency, scope, key }), settings.providerTimeoutMs)
  if (!result.ok) throw new Error(`provider unreachable: ${result.error}`)
  if (result.status !== 201) throw new Error(`provider answered ${result.status}: ${result.body}`)
  return JSON.parse(result.body) as { id: string }
}

async function shutdown (): Promise<void> {
  const force = setTimeout(() => process.exit(0), 5_000)
  force.unref()
  try {
    await app.close()
    await store.close()
    // Bounded: postgres.js 3.4.9's end() can hang after a connection died mid-query (porsager/postgres#1097).
    await sql.end({ timeout: 1 })
    redis.disconnect()
  } finally {
    process.exit(0)
  }
}

process.on('message', (message: unknown) => {
  if ((message as { type?: unknown } | null)?.type === 'shutdown') void shutdown()
})
process.on('disconnect', () => process.exit(0))

await app.listen({ host: '127.0.0.1', port: settings.port })
process.send?.({ type: 'ready', instance: settings.instance, pid: process.pid })
