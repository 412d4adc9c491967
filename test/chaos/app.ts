/**
 * One instance of the chaos harness's payments API: a Fastify app using the plugin with the shared
 * Postgres store (on postgres.js or node-postgres, CHAOS_PG_CLIENT: database.ts) and a Redis
 * pre-filter (standalone or cluster). Several run side by side on
 * loopback; the harness kills, restarts and skews them, and cuts each from the database on its own.
 *
 *   POST /payments/atomic  atomic mode: the effect is a ledger row written through the claim's
 *                          transaction (request.idempotency.sql: a TransactionSql or a PoolClient)
 *   POST /payments/lease   lease mode: the effect is a charge at the fake provider, made with a key
 *                          derived from (scope, key), so a re-run after a takeover replays it
 *   POST /scenarios/...    the lease-boundary situations (scenario-routes.ts): lease mode with a
 *                          300 ms lease (and some a 1 s ttl), slow handlers, slow streams, two steps
 *                          with a pause between them, an indeterminate failure after a step; and
 *                          atomic mode without `wait`, a handler holding its transaction a while
 *   GET  /health           { instance, now }: `now` is the instance's (possibly skewed) clock
 *
 * Every route answers 201 { mode, scope, key, amount, ref } (a stream adds a padding member): the
 * scope is the account header's, so the checker can see an answer that crossed scopes.
 *
 * Every execution leaves evidence in CHAOS_EVIDENCE (evidence.ts): the store calls that decide
 * ownership, the handler's start and end, each step run or refused, a client disconnect, a stream's
 * start and end. A planted bug (plants.ts, CHAOS_PLANT) sits between the plugin and that log.
 *
 * Run as `node --import tsx --import ./test/chaos/clock-skew.ts test/chaos/app.ts` with an IPC
 * channel; configured by CHAOS_* variables (see settingsFromEnv). Sends `{ type: 'ready', port }` once
 * listening; `{ type: 'shutdown' }` closes it gracefully; it exits when the channel closes.
 */
import { randomUUID } from 'node:crypto'
import type { AddressInfo } from 'node:net'
import { Readable } from 'node:stream'
import Fastify, { type FastifyReply, type FastifyRequest } from 'fastify'
import { Cluster, Redis } from 'ioredis'
import idempotency, { type IdempotencyContext } from '../../lib/index.js'
import { postgresStore } from '../../drivers/postgres/index.js'
import { redisPrefilter } from '../../drivers/redis/index.js'
import { exec } from '../helpers/postgres-clients.js'
import { openDatabase, pgClientFromEnv, type PgClient } from './database.js'
import { providerKeyFor } from './derive.js'
import { evidenceLog, loggedStore, watchStalls } from './evidence.js'
import { post } from './http.js'
import { markStopped, plantedStore, PLANTS, type Plant, type StoppedRenewals } from './plants.js'
import { SCENARIO_ROUTES, streamedParts, type ScenarioParameters } from './scenario-routes.js'
import { sleep } from '../helpers/sleep.js'
import { clusterNodes } from '../helpers/redis-nodes.js'

interface Settings {
  readonly instance: number
  readonly databaseUrl: string
  /** The client the store runs on (database.ts). */
  readonly client: PgClient
  /** `standalone:redis://host:port` or `cluster:host:port,host:port,...` */
  readonly redis: string
  /** False on the store-only instance (CHAOS_PREFILTER=off): its duplicates reach the store, none answered from Redis. */
  readonly prefilter: boolean
  readonly providerPort: number
  readonly leaseMs: number
  readonly waitMs: number
  readonly storeTimeoutMs: number
  readonly providerTimeoutMs: number
  /** Upper bound of a random pause inside each handler, after its effect: widens the crash windows. */
  readonly handlerDelayMs: number
  /** The JSONL file this instance's evidence goes to (every incarnation appends). */
  readonly evidenceFile: string
  readonly plant: Plant | null
}

/** The app's default ttl (the plugin's): what exec-start reports for routes without their own. */
const DEFAULT_TTL_MS = 86_400_000

function settingsFromEnv (env: NodeJS.ProcessEnv): Settings {
  const need = (name: string): string => {
    const value = env[name]
    if (value === undefined || value === '') throw new Error(`chaos app: ${name} is required`)
    return value
  }
  const plant = env.CHAOS_PLANT === undefined || env.CHAOS_PLANT === '' ? null : env.CHAOS_PLANT as Plant
  if (plant !== null && !PLANTS.includes(plant)) throw new Error(`chaos app: unknown plant ${plant}`)
  return {
    instance: Number(need('CHAOS_INSTANCE')),
    databaseUrl: need('CHAOS_DATABASE_URL'),
    client: pgClientFromEnv(env.CHAOS_PG_CLIENT),
    redis: need('CHAOS_REDIS'),
    prefilter: env.CHAOS_PREFILTER !== 'off',
    providerPort: Number(need('CHAOS_PROVIDER_PORT')),
    leaseMs: Number(env.CHAOS_LEASE_MS ?? '3000'),
    waitMs: Number(env.CHAOS_WAIT_MS ?? '250'),
    storeTimeoutMs: Number(env.CHAOS_STORE_TIMEOUT_MS ?? '2000'),
    providerTimeoutMs: Number(env.CHAOS_PROVIDER_TIMEOUT_MS ?? '1500'),
    handlerDelayMs: Number(env.CHAOS_HANDLER_DELAY_MS ?? '30'),
    evidenceFile: need('CHAOS_EVIDENCE'),
    plant
  }
}

const settings = settingsFromEnv(process.env)
const log = evidenceLog(settings.evidenceFile, settings.instance)
watchStalls(log)

// application_name lets the harness terminate exactly the apps' backends (the pg-terminate fault).
const database = openDatabase(settings.client, { url: settings.databaseUrl, max: 12, applicationName: `chaos-app-${settings.instance}` })

function redisClient (): Redis | Cluster {
  // No offline queue and no per-command retries: a Redis outage must fail fast so the pre-filter
  // falls through to the store (lib/core/prefilter.ts: Redis never decides).
  if (settings.redis.startsWith('cluster:')) {
    const nodes = clusterNodes(settings.redis.slice('cluster:'.length))
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
const realStore = postgresStore({ ...database.connection, purgeInterval: 0 })
/** Keys whose renewals a planted bug skips (abandon- and stream-stops-renewal). */
const stoppedRenewals: StoppedRenewals = new Set()
const store = plantedStore(loggedStore(realStore, log), settings.plant, database.run, log, stoppedRenewals)
const app = Fastify({ logger: { level: process.env.CHAOS_LOG_LEVEL ?? 'silent' } })

// Authentication stand-in: the account header is the principal (draft §5: keys are scoped to it).
app.addHook('onRequest', async (request, reply) => {
  if (request.method === 'POST' && typeof request.headers['x-account'] !== 'string') {
    return reply.code(401).send({ error: 'x-account required' })
  }
})

if (settings.plant === 'stream-stops-renewal') {
  // The planted bug's trigger: the response of an owner started (the old plugin stopped renewing here).
  app.addHook('onSend', async (request) => {
    const idem = request.idempotency
    if (idem !== null && idem !== undefined && !idem.replayed) markStopped(stoppedRenewals, idem.scope, idem.key)
  })
}

await app.register(idempotency, {
  store,
  ...(settings.prefilter ? { prefilter: redisPrefilter({ client: redis, prefix: 'chaos', timeout: 50 }) } : {}),
  scope: (request: FastifyRequest) => request.headers['x-account'] as string,
  required: true,
  lease: settings.leaseMs,
  wait: settings.waitMs,
  storeTimeout: settings.storeTimeoutMs,
  retryAfter: 1
})

interface PaymentRequest extends ScenarioParameters { amount: number, currency: string }
const bodySchema = {
  type: 'object',
  required: ['amount', 'currency'],
  additionalProperties: false,
  properties: { amount: { type: 'integer', minimum: 1 }, currency: { type: 'string', minLength: 3, maxLength: 3 } }
} as const
const scenarioBodySchema = {
  ...bodySchema,
  properties: {
    ...bodySchema.properties,
    delayMs: { type: 'integer', minimum: 0, maximum: 10_000 },
    pauseMs: { type: 'integer', minimum: 0, maximum: 10_000 },
    chunks: { type: 'integer', minimum: 0, maximum: 1_000 },
    chunkBytes: { type: 'integer', minimum: 0, maximum: 65_536 },
    intervalMs: { type: 'integer', minimum: 0, maximum: 1_000 }
  }
} as const

type Handler = (request: FastifyRequest<{ Body: PaymentRequest }>, reply: FastifyReply, idem: IdempotencyContext) => Promise<FastifyReply>

/**
 * A route whose every execution leaves evidence: its start (with the route's lease and ttl), its
 * end and how, the client leaving before its answer finished, the response closing.
 */
function route (path: string, name: string, options: { leaseMs: number, ttlMs: number, transaction?: boolean, waitMs?: number }, handler: Handler): void {
  const idempotencyConfig = {
    lease: options.leaseMs,
    ttl: options.ttlMs,
    ...(options.transaction === true ? { transaction: true } : {}),
    ...(options.waitMs === undefined ? {} : { wait: options.waitMs })
  }
  app.post<{ Body: PaymentRequest }>(path, {
    schema: { body: path.startsWith('/scenarios/') ? scenarioBodySchema : bodySchema },
    config: { idempotency: idempotencyConfig }
  }, async (request, reply) => {
    const idem = request.idempotency
    if (idem === null || idem === undefined) throw new Error('not protected')
    const req = request.id
    log({ ev: 'exec-start', req, scope: idem.scope, key: idem.key, route: name, leaseMs: options.leaseMs, ttlMs: options.ttlMs })
    reply.raw.once('close', () => {
      const finished = reply.raw.writableFinished
      if (!finished) {
        log({ ev: 'client-gone', req })
        if (settings.plant === 'abandon-stops-renewal') markStopped(stoppedRenewals, idem.scope, idem.key)
      }
      log({ ev: 'response-close', req, finished })
    })
    try {
      const sent = await handler(request, reply, idem)
      log({ ev: 'exec-end', req, how: 'returned' })
      return sent
    } catch (err) {
      log({ ev: 'exec-end', req, how: 'threw', error: (err as Error).name })
      throw err
    }
  })
}

/**
 * `request.idempotency.step(name, fn)` with evidence: the call, `fn` actually starting (and
 * finishing), a refusal with LeaseLostError. The planted `step-before-fence` runs the effect first
 * and hands step() its result, as the old step() ran `fn` before any fenced store call.
 */
async function step<T> (request: FastifyRequest, idem: IdempotencyContext, name: string, fn: () => Promise<T>): Promise<T> {
  const req = request.id
  log({ ev: 'step-call', req, name })
  const effect = async (): Promise<T> => {
    log({ ev: 'step-run', req, name })
    const value = await fn()
    log({ ev: 'step-done', req, name })
    return value
  }
  try {
    if (settings.plant === 'step-before-fence') {
      const value = await effect()
      return await idem.step(name, () => value)
    }
    return await idem.step(name, effect)
  } catch (err) {
    if ((err as Error).name === 'LeaseLostError') log({ ev: 'step-refused', req, name, error: (err as Error).message })
    throw err
  }
}

function providerKey (idem: IdempotencyContext): string {
  return settings.plant === 'provider-key-per-attempt'
    ? randomUUID() // the planted bug: a key per attempt, so a re-run charges again
    : typeof idem.deriveKey === 'function' ? idem.deriveKey('charge') : providerKeyFor(idem.scope, idem.key, 'charge')
}

function charge (request: FastifyRequest<{ Body: PaymentRequest }>, idem: IdempotencyContext): () => Promise<{ id: string }> {
  return () => chargeAtProvider(providerKey(idem), idem.scope, idem.key, request.body)
}

function answer (reply: FastifyReply, idem: IdempotencyContext, amount: number, ref: string): FastifyReply {
  return reply.code(201).send({ mode: 'lease', scope: idem.scope, key: idem.key, amount, ref })
}

route('/payments/atomic', 'atomic', { leaseMs: settings.leaseMs, ttlMs: DEFAULT_TTL_MS, transaction: true }, async (request, reply, idem) => {
  const tx = idem.sql
  if (tx === undefined) throw new Error('not in atomic mode')
  const ref = randomUUID()
  await exec(tx, 'INSERT INTO ledger (id, scope, key, amount) VALUES ($1, $2, $3, $4)', [ref, idem.scope, idem.key, request.body.amount])
  await sleep(Math.random() * settings.handlerDelayMs)
  return reply.code(201).send({ mode: 'atomic', scope: idem.scope, key: idem.key, amount: request.body.amount, ref })
})

route('/payments/lease', 'lease', { leaseMs: settings.leaseMs, ttlMs: DEFAULT_TTL_MS }, async (request, reply, idem) => {
  const result = await step(request, idem, 'charge', charge(request, idem))
  await sleep(Math.random() * settings.handlerDelayMs)
  return answer(reply, idem, request.body.amount, result.id)
})

const scenarioOptions = (scenario: keyof typeof SCENARIO_ROUTES): { leaseMs: number, ttlMs: number } =>
  ({ leaseMs: SCENARIO_ROUTES[scenario].leaseMs, ttlMs: SCENARIO_ROUTES[scenario].ttlMs ?? DEFAULT_TTL_MS })

// A charge (a recovery point), then a handler slower than the lease (slow) and than the ttl (slow-ttl);
// abandon: the same, while its client has left.
for (const scenario of ['slow', 'slow-ttl', 'abandon'] as const) {
  route(SCENARIO_ROUTES[scenario].path, scenario, scenarioOptions(scenario), async (request, reply, idem) => {
    const result = await step(request, idem, 'charge', charge(request, idem))
    await sleep(request.body.delayMs ?? 0)
    return answer(reply, idem, request.body.amount, result.id)
  })
}

// A charge (with its derived key, no step), then the answer streamed slowly: `chunks` parts of
// padding, one every `intervalMs` (stream-paused: large parts, and a client that stops reading).
route(SCENARIO_ROUTES.stream.path, 'stream', scenarioOptions('stream'), async (request, reply, idem) => {
  const result = await charge(request, idem)()
  const parts = streamedParts({ mode: 'lease', scope: idem.scope, key: idem.key, amount: request.body.amount, ref: result.id }, request.body.chunks ?? 10, request.body.chunkBytes ?? 1_024)
  const req = request.id
  const body = slowStream(parts, request.body.intervalMs ?? 100, () => log({ ev: 'stream-start', req }), (how) => log({ ev: 'stream-end', req, how }))
  reply.header('content-type', 'application/json; charset=utf-8')
  return reply.code(201).send(body)
})

// Two steps with a pause between them, during which the harness force-releases the key or cuts this
// instance from the database: the second step of a stale owner must not run.
route(SCENARIO_ROUTES['steps-force'].path, 'steps', scenarioOptions('steps-force'), async (request, reply, idem) => {
  // A local effect (a reservation): only the evidence log sees it.
  await step(request, idem, 'reserve', async () => ({ reservation: `${settings.instance}:${process.pid}:${request.id}` }))
  await sleep(request.body.pauseMs ?? 0)
  const result = await step(request, idem, 'charge', charge(request, idem))
  return answer(reply, idem, request.body.amount, result.id)
})

// A charge, then an answer nobody can interpret: the failure is indeterminate and the key is held for
// the reconciler (reconcile-policy.ts completes it from the recorded charge, after HELD_MIN_MS).
route(SCENARIO_ROUTES.held.path, 'held', scenarioOptions('held'), async (request, _reply, idem) => {
  await step(request, idem, 'charge', charge(request, idem))
  idem.markIndeterminate()
  log({ ev: 'mark-indeterminate', req: request.id })
  throw new Error('chaos: the bank\'s answer after the charge was ambiguous (indeterminate failure)')
})

/** A ledger row in the request's transaction, then the transaction held `delayMs` (wait-atomic, atomic-duplicate). */
async function heldLedgerWrite (request: FastifyRequest<{ Body: PaymentRequest }>, reply: FastifyReply, idem: IdempotencyContext): Promise<FastifyReply> {
  const tx = idem.sql
  if (tx === undefined) throw new Error('not in atomic mode')
  const ref = randomUUID()
  await exec(tx, 'INSERT INTO ledger (id, scope, key, amount) VALUES ($1, $2, $3, $4)', [ref, idem.scope, idem.key, request.body.amount])
  await sleep(request.body.delayMs ?? 0)
  return reply.code(201).send({ mode: 'atomic', scope: idem.scope, key: idem.key, amount: request.body.amount, ref })
}

// The wait-lease and wait-atomic scenarios: a charge (lease mode) or a ledger write (atomic mode), then a handler
// slower than the moment its duplicates arrive on the other instances, which wait for it.
route(SCENARIO_ROUTES['wait-lease'].path, 'wait-lease', { ...scenarioOptions('wait-lease'), waitMs: SCENARIO_ROUTES['wait-lease'].waitMs }, async (request, reply, idem) => {
  const result = await step(request, idem, 'charge', charge(request, idem))
  await sleep(request.body.delayMs ?? 0)
  return answer(reply, idem, request.body.amount, result.id)
})
route(SCENARIO_ROUTES['wait-atomic'].path, 'wait-atomic', { ...scenarioOptions('wait-atomic'), transaction: true, waitMs: SCENARIO_ROUTES['wait-atomic'].waitMs }, heldLedgerWrite)

// The atomic-duplicate scenario: the same ledger write, then the transaction held `delayMs` while
// duplicates arrive; the route has no `wait`, so their claims' lock waits are bounded by 1 ms.
route(SCENARIO_ROUTES['atomic-duplicate'].path, 'atomic-duplicate', { ...scenarioOptions('atomic-duplicate'), transaction: true, waitMs: SCENARIO_ROUTES['atomic-duplicate'].waitMs }, heldLedgerWrite)

app.get('/health', async () => ({ instance: settings.instance, now: Date.now() }))

/**
 * A body pushed one part per `intervalMs`, and only when the reader asks for more: a client that
 * stops reading holds it up once the buffers between them are full.
 */
function slowStream (parts: readonly Buffer[], intervalMs: number, onStart: () => void, onEnd: (how: 'end' | 'destroyed') => void): Readable {
  let next = 0
  let timer: NodeJS.Timeout | null = null
  let finished = false
  const finish = (how: 'end' | 'destroyed'): void => {
    if (finished) return
    finished = true
    onEnd(how)
  }
  const stream = new Readable({
    read () {
      if (next === 0 && timer === null) onStart()
      if (timer !== null) return
      timer = setTimeout(() => {
        timer = null
        const part = parts[next++]
        if (part === undefined) return
        stream.push(part)
        if (next === parts.length) stream.push(null)
      }, next === 0 ? 0 : intervalMs)
    },
    destroy (err, callback) {
      if (timer !== null) clearTimeout(timer)
      finish('destroyed')
      callback(err)
    }
  })
  stream.once('end', () => finish('end'))
  return stream
}

/** Any failure (a timeout, a reset, a non-201) throws: the plugin releases the key and the client retries. */
async function chargeAtProvider (key: string, scope: string, idempotencyKey: string, body: PaymentRequest): Promise<{ id: string }> {
  const result = await post(settings.providerPort, '/charges', {
    'content-type': 'application/json',
    'idempotency-key': key
  }, JSON.stringify({ amount: body.amount, currency: body.currency, scope, key: idempotencyKey }), settings.providerTimeoutMs)
  if (!result.ok) throw new Error(`provider unreachable: ${result.error}`)
  if (result.status !== 201) throw new Error(`provider answered ${result.status}: ${result.body}`)
  return JSON.parse(result.body) as { id: string }
}

async function shutdown (): Promise<void> {
  const force = setTimeout(() => process.exit(0), 5_000)
  force.unref()
  try {
    await app.close()
    await realStore.close()
    await database.end()
    redis.disconnect()
  } finally {
    process.exit(0)
  }
}

process.on('message', (message: unknown) => {
  if ((message as { type?: unknown } | null)?.type === 'shutdown') void shutdown()
})
process.on('disconnect', () => process.exit(0))

// Port 0: the kernel's pick, reported in `ready` (instances.ts points the instance's proxy at it).
await app.listen({ host: '127.0.0.1', port: 0 })
process.send?.({ type: 'ready', instance: settings.instance, pid: process.pid, port: (app.server.address() as AddressInfo).port })
