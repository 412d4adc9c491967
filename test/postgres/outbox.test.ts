import Fastify from 'fastify'
import postgres from 'postgres'
import t, { type Test } from 'tap'
import idempotency, { InvalidOptionError, type RouteIdempotencyOptions } from '../../lib/index.js'
import { deriveKey } from '../../lib/core/derive.js'
import { postgresStore, type OutboxMessage, type PostgresStore, type PostgresStoreOptions } from '../../drivers/postgres/index.js'
import { CLIENT, CLIENT_NAME, endPools, exec, poolLike, storeConnection } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The transactional outbox: a message exists exactly when the transaction that enqueued it
 * committed, is delivered after the commit with its derived key, retried with backoff when delivery
 * fails, and purged once delivered and past its retention. (Across a real crash:
 * test/postgres/crash.test.ts.) The store runs on the client under test
 * (test/helpers/postgres-clients.ts; the node-postgres run: test/postgres/node-postgres/outbox.test.ts):
 * a message is enqueued through that client's transaction handle, request.idempotency.sql in atomic
 * mode or the handle a transactional step's `fn` receives (a guarded PoolClient on node-postgres).
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/outbox.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const { name: schema, sql } = postgresSchema(t, url, { prefix: 'idem_outbox', client: { max: 10 } })
  let tables = 0

  t.teardown(endPools)

  interface World {
    store: PostgresStore
    table: string
    delivered: OutboxMessage[]
    failNext: number
    post: (key: string, url?: string) => Promise<{ statusCode: number, body: string }>
    outboxRows: () => Promise<Array<{ key: string, name: string, delivered_at: Date | null, attempts: number, last_error: string | null }>>
    until: (what: string, check: () => boolean) => Promise<void>
    /** Milliseconds until each undelivered message is due, by name. */
    dueIn: () => Promise<Record<string, number>>
    /** Makes every undelivered message due now, as if its backoff had passed. */
    makeDue: () => Promise<void>
  }

  async function world (t: Test, route: RouteIdempotencyOptions, options: Partial<PostgresStoreOptions> = {}, retryDelay = 50): Promise<World> {
    const table = `records_${++tables}`
    const w = { delivered: [] as OutboxMessage[], failNext: 0 } as World
    const store = postgresStore({
      ...storeConnection(sql),
      schema,
      table,
      purgeInterval: 0,
      outbox: {
        retryDelay,
        visibility: 200,
        deliver (message) {
          if (w.failNext > 0) { w.failNext--; throw new Error('broker unavailable') }
          w.delivered.push(message)
        }
      },
      ...options
    })
    await store.migrate()
    t.teardown(() => store.close())
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'acct_a', lease: 1000, ...route })
    app.post('/atomic', async (request) => {
      await request.idempotency?.enqueue({ name: 'receipt', topic: 'email', payload: { to: 'a@example.com' } })
      await request.idempotency?.enqueue({ name: 'receipt', topic: 'email', payload: { to: 'IGNORED: same name' } })
      await request.idempotency?.enqueue({ name: 'ledger', topic: 'kafka', payload: [1, 2] })
      return { ok: true }
    })
    app.post('/atomic-fails', async (request) => {
      await request.idempotency?.enqueue({ name: 'receipt', topic: 'email', payload: {} })
      throw new Error('after enqueue')
    })
    app.post('/lease', async (request) => {
      const context = request.idempotency
      if (context === null) throw new Error('unprotected')
      await context.step('receipt', async (tx) => { await context.enqueue({ name: 'receipt', topic: 'email', payload: { n: 1 } }, tx) }, { transaction: true })
      return { ok: true }
    })
    app.post('/lease-no-tx', async (request) => {
      await request.idempotency?.enqueue({ name: 'receipt', topic: 'email', payload: {} })
      return { ok: true }
    })
    w.store = store
    w.table = table
    w.post = async (key, path = '/atomic') => {
      const response = await app.inject({ method: 'POST', url: path, headers: { 'idempotency-key': `"${key}"` } })
      return { statusCode: response.statusCode, body: response.body }
    }
    w.outboxRows = async () => await sql`SELECT key, name, delivered_at, attempts, last_error FROM ${sql(schema)}.${sql(`${table}_outbox`)} ORDER BY key, name`
    w.dueIn = async () => {
      const rows = await sql<Array<{ name: string, ms: number }>>`
        SELECT name, (extract(epoch FROM next_attempt_at - now()) * 1000)::float8 AS ms
        FROM ${sql(schema)}.${sql(`${table}_outbox`)} WHERE delivered_at IS NULL`
      return Object.fromEntries(rows.map((row) => [row.name, row.ms]))
    }
    w.makeDue = async () => {
      await sql`UPDATE ${sql(schema)}.${sql(`${table}_outbox`)} SET next_attempt_at = now() WHERE delivered_at IS NULL`
    }
    w.until = async (what, check) => {
      const deadline = Date.now() + 5000
      while (!check()) {
        if (Date.now() > deadline) { t.fail(`timed out waiting for ${what}`); return }
        await sleep(10)
      }
    }
    return w
  }

  t.test('atomic mode: messages commit with the request and are delivered once, after the commit, with their derived keys', async (t) => {
    const w = await world(t, { transaction: true })
    t.equal((await w.post('o1')).statusCode, 200)
    await w.until('two deliveries', () => w.delivered.length === 2)
    t.same(w.delivered.map((m) => [m.name, m.topic, m.payload, m.deliveryKey, m.attempt]).sort(), [
      ['ledger', 'kafka', [1, 2], deriveKey('acct_a', 'o1', 'ledger'), 1],
      ['receipt', 'email', { to: 'a@example.com' }, deriveKey('acct_a', 'o1', 'receipt'), 1]
    ], 'the second enqueue of a name was a no-op')
    const rows = await w.outboxRows()
    t.ok(rows.every((row) => row.delivered_at instanceof Date), 'marked delivered')
    t.equal((await w.post('o1')).statusCode, 200, 'a replay')
    t.same(await w.store.deliverOutbox(), { delivered: 0, failed: 0 }, 'nothing left for the worker')
    t.equal(w.delivered.length, 2, 'a replay enqueues nothing')
  })

  t.test('atomic mode: a handler that fails after enqueueing rolls the message back: never delivered', async (t) => {
    const w = await world(t, { transaction: true })
    t.equal((await w.post('f1', '/atomic-fails')).statusCode, 500)
    await sleep(50)
    t.same(await w.outboxRows(), [])
    t.same(await w.store.deliverOutbox(), { delivered: 0, failed: 0 })
    t.equal(w.delivered.length, 0)
  })

  t.test('lease mode: enqueue through a transactional step; without one it is refused', async (t) => {
    const w = await world(t, {})
    t.equal((await w.post('l1', '/lease')).statusCode, 200)
    await w.until('a delivery', () => w.delivered.length === 1)
    t.equal(w.delivered[0]?.deliveryKey, deriveKey('acct_a', 'l1', 'receipt'))
    t.equal((await w.post('l2', '/lease-no-tx')).statusCode, 500)
    t.same((await w.outboxRows()).map((row) => row.key), ['l1'])
  })

  const NOT_THE_TRANSACTION = /enqueue\(\) needs the transaction the message commits with/

  /**
   * Handles of the client under test that are not a transaction of this store: the message would
   * commit on its own (the client, the pool) or with a transaction the store knows nothing of.
   * Each comes with what ends it.
   */
  async function foreignHandles (): Promise<Array<{ label: string, handle: unknown, done: () => Promise<void> }>> {
    if (CLIENT === 'postgres') {
      let finish!: () => void
      const held = new Promise<void>((resolve) => { finish = resolve })
      const opened = new Promise<postgres.TransactionSql>((resolve) => {
        void sql.begin(async (tx) => { resolve(tx); await held })
      })
      const tx = await opened
      return [
        { label: 'the client itself', handle: sql, done: async () => {} },
        { label: 'a transaction of its own (sql.begin)', handle: tx, done: async () => { finish() } }
      ]
    }
    const pool = poolLike(sql)
    const client = await pool.connect()
    await client.query('BEGIN')
    return [
      { label: 'the pool itself', handle: pool, done: async () => {} },
      { label: 'a PoolClient of the same pool, inside a BEGIN of its own', handle: client, done: async () => { await client.query('ROLLBACK'); client.release() } }
    ]
  }

  t.test(`enqueue() through a handle that is not the store's transaction is refused with a TypeError; nothing is enqueued (${CLIENT_NAME})`, async (t) => {
    const w = await world(t, {})
    const foreign = await foreignHandles()
    t.teardown(async () => { for (const { done } of foreign) await done() })
    for (const { label, handle } of foreign) {
      await t.rejects(w.store.enqueue(handle, { scope: 'acct_a', key: 'direct', name: 'receipt', topic: 'email', payload: {} }),
        { name: 'TypeError', message: NOT_THE_TRANSACTION }, `store.enqueue: ${label}`)
    }

    // From a transactional step: the step fails (and rolls back), so the request does.
    let picked = 0
    let caught: unknown = null
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store: w.store, scope: () => 'acct_a', lease: 1000 })
    app.setErrorHandler((error, _request, reply) => { caught = error; return reply.code(500).send() })
    app.post('/foreign', async (request) => {
      const context = request.idempotency
      if (context === null) throw new Error('unprotected')
      const handle = foreign[picked]?.handle
      await context.step('receipt', async () => { await context.enqueue({ name: 'receipt', topic: 'email', payload: {} }, handle) }, { transaction: true })
      return { ok: true }
    })
    for (; picked < foreign.length; picked++) {
      caught = null
      const response = await app.inject({ method: 'POST', url: '/foreign', headers: { 'idempotency-key': `"foreign-${picked}"` } })
      t.equal(response.statusCode, 500, `a step enqueueing through ${foreign[picked]?.label ?? ''} fails`)
      t.match(caught, { name: 'TypeError', message: NOT_THE_TRANSACTION })
    }
    for (const { done } of foreign.splice(0)) await done()
    await sleep(50)
    t.same(await w.outboxRows(), [], 'no message was enqueued')
    t.same(await w.store.deliverOutbox(), { delivered: 0, failed: 0 })
    t.equal(w.delivered.length, 0)
  })

  t.test(`a step's handle kept past the step: enqueue() through it is refused; nothing is enqueued (${CLIENT_NAME})`, async (t) => {
    const w = await world(t, {})
    let kept: unknown = null
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store: w.store, scope: () => 'acct_a', lease: 1000 })
    app.post('/keep', async (request) => {
      const context = request.idempotency
      if (context === null) throw new Error('unprotected')
      await context.step('keep', async (tx) => {
        kept = tx
        // A query of its own: the handle worked inside the step.
        await exec(tx, 'SELECT 1')
      }, { transaction: true })
      return { ok: true }
    })
    t.equal((await app.inject({ method: 'POST', url: '/keep', headers: { 'idempotency-key': '"kept"' } })).statusCode, 200)
    await t.rejects(w.store.enqueue(kept, { scope: 'acct_a', key: 'kept', name: 'late', topic: 'email', payload: {} }), { message: /transaction has ended/ })
    t.same(await w.outboxRows(), [], 'nothing was enqueued')
  })

  t.test('a failed delivery is retried with backoff by the worker, then delivered once', async (t) => {
    // A minute's first retry delay: no message can come due by itself while the test looks, so
    // each retry below is due because the test moved its time, whatever the machine's load.
    const retryDelay = 60_000
    const w = await world(t, { transaction: true }, {}, retryDelay)
    w.failNext = 3
    await w.post('r1')
    await w.until('the first attempts to fail', () => w.failNext === 1)
    // The worker records a failure just after deliver() threw.
    let failed = await w.outboxRows()
    for (let i = 0; i < 200 && !failed.every((row) => row.attempts === 1 && row.last_error !== null); i++) {
      await sleep(10)
      failed = await w.outboxRows()
    }
    t.ok(failed.every((row) => row.delivered_at === null && row.last_error === 'broker unavailable' && row.attempts === 1), 'both failed once')
    for (const [name, ms] of Object.entries(await w.dueIn())) {
      t.ok(ms > retryDelay - 10_000 && ms <= retryDelay, `${name}: due again after the first retry delay (${Math.round(ms)} ms)`)
    }
    let report = await w.store.deliverOutbox()
    t.same(report, { delivered: 0, failed: 0 }, 'not due yet: the backoff')
    await w.makeDue()
    report = await w.store.deliverOutbox()
    t.same(report, { delivered: 1, failed: 1 }, 'one more failure, one delivery')
    const [again, ...others] = Object.values(await w.dueIn())
    t.same(others, [], 'one message left')
    t.ok(again !== undefined && again > 2 * retryDelay - 10_000 && again <= 2 * retryDelay, `the second retry delay is twice the first (${Math.round(again ?? 0)} ms)`)
    t.same(await w.store.deliverOutbox(), { delivered: 0, failed: 0 }, 'not due yet: the doubled backoff')
    await w.makeDue()
    report = await w.store.deliverOutbox()
    t.same(report, { delivered: 1, failed: 0 })
    // Both were enqueued by one transaction (same created_at): which one failed twice is not fixed.
    t.same(w.delivered.map((m) => m.name).sort(), ['ledger', 'receipt'], 'each delivered once')
    t.same(w.delivered.map((m) => m.attempt).sort(), [2, 3], 'on their second and third attempts')
    t.ok((await w.outboxRows()).every((row) => row.delivered_at instanceof Date && row.last_error === null))
  })

  t.test('delivered messages are purged after their retention; undelivered ones never are', async (t) => {
    const w = await world(t, { transaction: true }, { outbox: { retention: 0, deliver: () => { throw new Error('down') } } })
    await w.post('p1')
    await sleep(50)
    await sql`UPDATE ${sql(schema)}.${sql(`${w.table}_outbox`)} SET delivered_at = now() WHERE name = 'receipt'`
    await sleep(5)
    await w.store.purgeExpired()
    t.same((await w.outboxRows()).map((row) => row.name), ['ledger'])
  })

  t.test('background failures reach onBackgroundError: the purge timer, and a delivery after commit', async (t) => {
    const seen: Array<[string, string]> = []
    // No migrate(): the table does not exist, so every background statement fails.
    const store = postgresStore({
      ...storeConnection(sql),
      schema,
      table: 'never_created',
      purgeInterval: 20,
      outbox: { deliver: () => {} },
      onBackgroundError: (err, task) => { seen.push([task, String((err as { code?: string }).code)]) }
    })
    const deadline = Date.now() + 5000
    while (!seen.some(([task]) => task === 'purge') && Date.now() < deadline) await sleep(10)
    store.afterCommit({ scope: 's', key: 'k' })
    while (!seen.some(([task]) => task === 'outbox') && Date.now() < deadline) await sleep(10)
    await store.close()
    t.ok(seen.some(([task, code]) => task === 'purge' && code === '42P01'), 'the purge error (undefined table)')
    t.ok(seen.some(([task, code]) => task === 'outbox' && code === '42P01'), 'the delivery error')
    t.throws(() => postgresStore({ ...storeConnection(sql), onBackgroundError: 'log' as never }), { message: /onBackgroundError/ })
  })

  t.test('options and misuse', async (t) => {
    t.throws(() => postgresStore({ ...storeConnection(sql), outbox: {} as never }), InvalidOptionError)
    t.throws(() => postgresStore({ ...storeConnection(sql), outbox: { deliver: () => {}, retryDelay: 0 } }), { message: /outbox\.retryDelay/ })
    const plain = postgresStore({ ...storeConnection(sql), schema, table: 'records_plain', purgeInterval: 0 })
    await plain.migrate()
    await t.rejects(plain.deliverOutbox(), { message: /no outbox/ })
    await t.rejects(plain.enqueue(sql, { scope: 's', key: 'k', name: 'n', topic: 't', payload: 1 }), { message: /no outbox/ })
    await plain.close()
  })
}
