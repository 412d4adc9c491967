import { randomUUID } from 'node:crypto'
import Fastify, { type FastifyInstance } from 'fastify'
import postgres from 'postgres'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type IdempotencyOptions } from '../../lib/index.js'
import { postgresStore } from '../../drivers/postgres/index.js'
import { createIdempotentClient, type IdempotentResponse } from '../../client/index.js'
import { startFaultProxy } from '../helpers/fault-proxy.js'
import { postgresSchema } from '../helpers/postgres-schema.js'

/*
 * The unknown-outcome window end to end: the client talks to the app through a TCP proxy
 * that, on half of the connections, destroys the client side when the server's first reply bytes
 * arrive. The server committed; the client never heard. Every logical operation must still end in
 * success, with exactly one effect, the lost answers replayed, and every answer for a key identical.
 *
 * Each attempt opens a fresh connection (`Connection: close`, which undici honours by not reusing
 * the socket). The proxy draws its drop once per connection, at the first reply; over kept-alive
 * connections only the first request of each connection could lose its answer, and after a few
 * surviving connections almost no attempt would. One connection per attempt makes every attempt,
 * retries included, face the same 50% loss.
 */

const OPERATIONS = 200
const CONCURRENCY = 10
const DROP_PROBABILITY = 0.5

/** mulberry32: a small seeded PRNG, so a failing run can be replayed with its seed. */
function seeded (seed: number): () => number {
  let state = seed >>> 0
  return () => {
    state = (state + 0x6d2b79f5) >>> 0
    let x = Math.imul(state ^ (state >>> 15), 1 | state)
    x = (x + Math.imul(x ^ (x >>> 7), 61 | x)) ^ x
    return ((x ^ (x >>> 14)) >>> 0) / 4_294_967_296
  }
}

/** What the server observed, per key. */
interface ServerLog {
  /** Requests that reached the server (each attempt the proxy forwarded). */
  readonly attempts: Map<string, number>
  /** Every answer the server sent (`status body`), originals and replays, lost or not. */
  readonly answers: Map<string, string[]>
}

/** An app on `plugin`'s store whose /pay runs `effect` and answers with a body unique to the execution. */
async function payApp (t: Test, plugin: IdempotencyOptions, effect: (key: string, amount: number, request: unknown) => Promise<string>): Promise<{ app: FastifyInstance, log: ServerLog }> {
  const app = Fastify({ forceCloseConnections: true })
  t.teardown(() => app.close())
  await app.register(idempotency, { scope: () => 'test', ...plugin })
  const log: ServerLog = { attempts: new Map(), answers: new Map() }
  const keyOf = (headers: Record<string, unknown>): string => String(headers['idempotency-key'] ?? '').slice(1, -1)
  app.addHook('onRequest', async (request) => {
    const key = keyOf(request.headers)
    log.attempts.set(key, (log.attempts.get(key) ?? 0) + 1)
  })
  app.addHook('onSend', async (request, reply, payload) => {
    const key = keyOf(request.headers)
    const body = typeof payload === 'string' || Buffer.isBuffer(payload) ? payload.toString() : `(a ${typeof payload} payload)`
    log.answers.set(key, [...(log.answers.get(key) ?? []), `${reply.statusCode} ${body}`])
    return payload
  })
  app.post<{ Body: { amount: number } }>('/pay', async (request, reply) => {
    const key = request.idempotency?.key ?? ''
    const id = await effect(key, request.body.amount, request)
    return reply.code(201).send({ id, key, amount: request.body.amount })
  })
  await app.listen({ host: '127.0.0.1', port: 0 })
  return { app, log }
}

interface Operation { readonly amount: number, readonly result: IdempotentResponse }

/** OPERATIONS logical payments, CONCURRENCY at a time, through a proxy dropping DROP_PROBABILITY of the answers. */
async function storm (t: Test, app: FastifyInstance, seed: number): Promise<{ operations: Operation[], dropped: number, connections: number }> {
  const address = app.server.address()
  const port = typeof address === 'object' && address !== null ? address.port : 0
  const proxy = await startFaultProxy({ host: '127.0.0.1', port }, { dropReplyProbability: DROP_PROBABILITY }, { random: seeded(seed) })
  t.teardown(async () => { await proxy.close() })
  const client = createIdempotentClient({
    baseUrl: `http://127.0.0.1:${proxy.port}`,
    headers: { connection: 'close' },
    // 0.5^30: no operation runs out of attempts in any run that will ever happen.
    maxAttempts: 30,
    backoff: { baseMs: 1, maxMs: 10 },
    random: seeded(seed + 1)
  })
  const operations: Operation[] = []
  let next = 0
  async function worker (): Promise<void> {
    while (next < OPERATIONS) {
      const amount = ++next
      operations.push({ amount, result: await client.post('/pay', { body: { amount } }) })
    }
  }
  await Promise.all(Array.from({ length: CONCURRENCY }, worker))
  return { operations, dropped: proxy.stats.dropped, connections: proxy.stats.connections }
}

/** Everything the issue asks of the run, given how many effects each key had. */
function check (t: Test, seed: number, run: { operations: Operation[], dropped: number, connections: number }, log: ServerLog, effects: Map<string, number>): void {
  const { operations } = run
  t.comment(`seed ${seed}: ${operations.length} operations, ${run.connections} attempts, ${run.dropped} answers dropped`)
  t.equal(operations.length, OPERATIONS)
  t.ok(operations.every((op) => op.result.status === 201), 'every operation eventually succeeded')
  t.equal(new Set(operations.map((op) => op.result.key)).size, OPERATIONS, 'one key per operation')
  t.equal(effects.size, OPERATIONS, 'an effect for every operation and for no other key')
  t.same(operations.filter((op) => effects.get(op.result.key as string) !== 1).map((op) => op.result.key), [], 'exactly one effect per operation')

  const attempts = operations.reduce((sum, op) => sum + op.result.attempts, 0)
  t.equal(run.connections, attempts, 'one connection per attempt')
  const answersOf = (op: Operation): string[] => log.answers.get(op.result.key as string) ?? []
  t.same(operations.filter((op) => log.attempts.get(op.result.key as string) !== op.result.attempts || answersOf(op).length !== op.result.attempts)
    .map((op) => op.result.key), [], 'the server saw and answered every attempt the client made, under the operation\'s one key')

  // The server's answers to one key come in attempt order, the last one being what the client got.
  // A 201 before the last was the execution (or a replay) whose answer the proxy dropped.
  // Transient answers (409, 503) are legitimate under load and retried; they are reported, not failed.
  const received = (op: Operation): string => `201 ${op.result.text()}`
  t.same(operations.filter((op) => answersOf(op).at(-1) !== received(op) || answersOf(op).some((answer) => answer.startsWith('2') && answer !== received(op)))
    .map((op) => ({ key: op.result.key, attempts: op.result.attempts, received: op.result.text(), sent: answersOf(op) })), [],
  'every 2xx answer sent for a key, lost or received, has the same body, the one the client got')
  const lostFirst = operations.filter((op) => answersOf(op).findIndex((answer) => answer.startsWith('2')) < op.result.attempts - 1)
  t.ok(lostFirst.length >= OPERATIONS / 4 && lostFirst.length <= OPERATIONS * 3 / 4, `about half the operations lost the answer of their execution (${lostFirst.length})`)
  t.same(operations.filter((op) => op.result.replayed !== lostFirst.includes(op)).map((op) => op.result.key), [],
    'replayed: true exactly for the operations whose execution\'s answer was dropped')
  const lostAnswers = operations.reduce((sum, op) => sum + answersOf(op).slice(0, -1).filter((answer) => answer.startsWith('2')).length, 0)
  t.ok(run.dropped >= lostAnswers && run.dropped <= attempts - OPERATIONS, 'every 2xx before the last was dropped; every retry followed a drop or a transient answer')
  const transient = operations.flatMap((op) => answersOf(op).filter((answer) => !answer.startsWith('2')).map((answer) => answer.slice(0, 3)))
  t.comment(`transient answers (retried): ${transient.length === 0 ? 'none' : transient.join(' ')}`)
  t.ok(operations.every((op) => (op.result.json() as { amount: number }).amount === op.amount), 'each operation got its own payment back')
}

t.test('memory store: 200 operations through a proxy losing half the answers, one effect each', async (t) => {
  const seed = 0x5eed
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const effects = new Map<string, number>()
  const { app, log } = await payApp(t, { store }, async (key) => {
    effects.set(key, (effects.get(key) ?? 0) + 1)
    return randomUUID()
  })
  check(t, seed, await storm(t, app, seed), log, effects)
})

t.test('PostgreSQL atomic mode: 200 operations through the same proxy, one committed row each', async (t) => {
  const url = process.env.DATABASE_URL
  if (url === undefined || url === '') {
    t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/client-helper/faults.test.ts` (it provisions a throwaway PostgreSQL).')
    return
  }
  const seed = 0xa70e1c
  const fresh = postgresSchema(t, url, {
    prefix: 'idem_client',
    client: { max: CONCURRENCY + 2 },
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.payments (id bigserial PRIMARY KEY, key text NOT NULL, amount integer NOT NULL)`
  })
  const { name: schema, sql } = fresh
  await fresh.ready()
  const store = postgresStore({ sql, schema, table: 'records', purgeInterval: 0 })
  await store.migrate()
  t.teardown(() => store.close())

  const { app, log } = await payApp(t, { store, transaction: true }, async (key, amount, request) => {
    const tx = (request as { idempotency: { sql?: postgres.TransactionSql } }).idempotency.sql
    if (tx === undefined) throw new Error('no transaction: atomic mode is off')
    const [row] = await tx`INSERT INTO ${tx(schema)}.payments (key, amount) VALUES (${key}, ${amount}) RETURNING id`
    return String(row?.id)
  })
  const run = await storm(t, app, seed)
  const rows = await sql`SELECT key, count(*)::int AS n FROM ${sql(schema)}.payments GROUP BY key`
  check(t, seed, run, log, new Map(rows.map((row) => [String(row.key), Number(row.n)])))
  const pending = await sql`SELECT count(*)::int AS n FROM ${sql(schema)}.records WHERE state <> 'completed'`
  t.equal(pending[0]?.n, 0, 'no record left in progress')
})
