import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { InvalidOptionError, memoryStore, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import { REFERENCE_HEADER } from '../../lib/http/reference.js'
import { postgresStore } from '../../drivers/postgres/index.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Responses by reference (`rebuild` option): the record keeps `request.idempotency.reference`
 * instead of the body, and a replay rebuilds the answer from the resource's current state.
 */

interface Payment { id: string, amount: number, status: string, receipt: string }

async function payments (t: Test, store: IdempotencyStore, options: IdempotencyOptions = {}): Promise<{ app: FastifyInstance, db: Map<string, Payment>, runs: () => number, rebuilds: () => number }> {
  const db = new Map<string, Payment>()
  let runs = 0
  let rebuilds = 0
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: () => 'acct', ...options })
  app.post('/payments', {
    config: {
      idempotency: {
        rebuild: async (reference) => {
          rebuilds++
          const payment = db.get((reference as { id: string }).id)
          return payment === undefined
            ? { statusCode: 404, body: { error: 'payment deleted since' } }
            : { body: payment, headers: { 'x-rebuilt': 'yes' } }
        }
      }
    }
  }, async (request, reply) => {
    runs++
    const payment: Payment = { id: `pay_${runs}`, amount: (request.body as { amount: number }).amount, status: 'succeeded', receipt: 'r'.repeat(4096) }
    db.set(payment.id, payment)
    if (request.idempotency !== null) request.idempotency.reference = { type: 'payment', id: payment.id }
    return reply.code(201).header('location', `/payments/${payment.id}`).send(payment)
  })
  app.post('/no-reference', { config: { idempotency: { rebuild: async () => ({ body: 'never' }) } } }, async () => ({ full: true }))
  return { app, db, runs: () => runs, rebuilds: () => rebuilds }
}

const pay = (app: FastifyInstance, key: string, amount = 100, url = '/payments') =>
  app.inject({ method: 'POST', url, headers: { 'idempotency-key': `"${key}"` }, payload: { amount } })

function behaviours (name: string, makeStore: (t: Test) => Promise<IdempotencyStore>): void {
  t.test(`${name}: the reference is recorded, not the body; a replay rebuilds from current state`, async (t) => {
    const store = await makeStore(t)
    const h = await payments(t, store)
    const first = await pay(h.app, 'p1')
    t.equal(first.statusCode, 201)
    t.equal(first.json<Payment>().status, 'succeeded')

    const record = await store.get({ scope: 'acct', key: 'p1' })
    const response = record?.state === 'completed' ? record.response : null
    t.same(JSON.parse(String(response?.body)), { type: 'payment', id: 'pay_1' }, 'the record holds the reference')
    t.ok((response?.body?.length ?? Infinity) < 100, `a few bytes instead of ${first.rawPayload.length}`)
    t.equal(response?.headers.location, '/payments/pay_1', 'the original replayable headers are kept')
    t.equal(response?.headers[REFERENCE_HEADER], 'v1')

    const payment = h.db.get('pay_1') as Payment
    payment.status = 'refunded'
    const replay = await pay(h.app, 'p1')
    t.equal(replay.statusCode, 201, 'the original status')
    t.equal(replay.headers['idempotent-replayed'], 'true')
    t.equal(replay.headers.location, '/payments/pay_1')
    t.equal(replay.headers['x-rebuilt'], 'yes')
    t.equal(replay.headers[REFERENCE_HEADER], undefined, 'the marker never leaves')
    t.equal(replay.json<Payment>().status, 'refunded', 'the current state, not the original body (documented trade-off)')
    t.same([h.runs(), h.rebuilds()], [1, 1])

    h.db.delete('pay_1')
    const gone = await pay(h.app, 'p1')
    t.same([gone.statusCode, gone.json()], [404, { error: 'payment deleted since' }], 'rebuild decides what a vanished resource answers')
    t.equal(h.runs(), 1, 'never executed again')
    t.equal((await pay(h.app, 'p1', 999)).statusCode, 422, 'a different request is still 422')
  })

  t.test(`${name}: a handler that sets no reference is recorded in full`, async (t) => {
    const store = await makeStore(t)
    const h = await payments(t, store)
    await pay(h.app, 'n1', 1, '/no-reference')
    const replay = await pay(h.app, 'n1', 1, '/no-reference')
    t.same([replay.json(), replay.headers['idempotent-replayed']], [{ full: true }, 'true'])
    t.equal(h.rebuilds(), 0)
  })

  t.test(`${name}: a record holding a reference replayed by a route without rebuild is 410, not a re-execution`, async (t) => {
    const store = await makeStore(t)
    const before = await payments(t, store)
    await pay(before.app, 'moved')
    await before.app.close()
    const after = Fastify()
    t.teardown(() => after.close())
    await after.register(idempotency, { store, scope: () => 'acct' })
    let runs = 0
    after.post('/payments', async () => { runs++; return {} })
    const replay = await pay(after, 'moved')
    t.equal(replay.statusCode, 410)
    t.equal(runs, 0)
  })
}

behaviours('memory', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  return store
})

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/plugin/reference.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  const url = DATABASE_URL
  const { name: schema, sql } = postgresSchema(t, url, { prefix: 'idem_reference', client: { max: 4 } })
  let tables = 0
  behaviours('postgres', async (t) => {
    const store = postgresStore({ sql, schema, table: `records_${++tables}`, purgeInterval: 0 })
    await store.migrate()
    t.teardown(() => store.close())
    return store
  })

  t.test('postgres atomic mode: the reference commits with the handler\'s writes', async (t) => {
    const store = postgresStore({ sql, schema, table: `records_${++tables}`, purgeInterval: 0 })
    await store.migrate()
    t.teardown(() => store.close())
    const h = await payments(t, store, { transaction: true })
    await pay(h.app, 'a1')
    const [row] = await sql`SELECT response_body FROM ${sql(schema)}.${sql(`records_${tables}`)} WHERE key = 'a1'`
    t.same(JSON.parse(String(row?.response_body)), { type: 'payment', id: 'pay_1' })
    const replay = await pay(h.app, 'a1')
    t.equal(replay.json<Payment>().id, 'pay_1')
    // The replay's read-only claim transaction rolls back just after the answer.
    for (let i = 0; i < 100 && store.openTransactions > 0; i++) await sleep(10)
    t.equal(store.openTransactions, 0)
  })
}

t.test('rebuild must be a function', async (t) => {
  await t.rejects(async () => { await Fastify().register(idempotency, { rebuild: 'x' as never }) }, InvalidOptionError)
})
