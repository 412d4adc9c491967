import { randomBytes } from 'node:crypto'
import diagnostics from 'node:diagnostics_channel'
import Fastify, { type FastifyInstance } from 'fastify'
import postgres from 'postgres'
import t from 'tap'
import idempotency, { DECISION_CHANNEL, type DecisionEvent } from '../../lib/index.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { CLIENT_NAME, endPools, exec, storeConnection } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Atomic mode against a real PostgreSQL: a claim that lands after the request was already answered
 * (Fastify's handlerTimeout runs from routing, so it can answer while the duplicate waits for
 * another attempt's uncommitted claim) is rolled back at once. Left open, its transaction would hold a pooled
 * connection and the row's lock for good ("idle in transaction"), and every retry of the key would
 * be answered 409. The node-postgres run: test/postgres/node-postgres/atomic-late-claim.test.ts.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/atomic-late-claim.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

const keyed = (key: string): Record<string, string> => ({ 'idempotency-key': `"${key}"`, 'content-type': 'application/json' })

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const appName = `idem-late-claim-${id}`
  const sql = postgres(url, { max: 10, onnotice: () => {}, connection: { application_name: appName } })
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_late_claim',
    client: { max: 2 },
    migrate: ['records'],
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.payments (key text NOT NULL, instance text NOT NULL)`
  })
  const payTable = `"${schema}".payments`
  t.teardown(async () => {
    await sql.end({ timeout: 2 })
    await endPools()
  })

  const payments = async (key: string): Promise<string[]> =>
    (await admin<Array<{ instance: string }>>`SELECT instance FROM ${admin(schema)}.payments WHERE key = ${key}`).map((row) => row.instance)
  const idleInTransaction = async (): Promise<number> =>
    Number((await admin`SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = ${appName} AND state LIKE 'idle in transaction%'`)[0]?.n)

  t.test(`a claim that waited on another attempt's lock and landed after handlerTimeout answered is rolled back at once (${CLIENT_NAME})`, async (t) => {
    const store: PostgresStore = postgresStore({ ...storeConnection(sql), schema, table: 'records', purgeInterval: 0 })
    const runs: string[] = []
    let release!: () => void
    const gate = new Promise<void>((resolve) => { release = resolve })
    const instance = async (name: string, handlerTimeout?: number): Promise<FastifyInstance> => {
      const app = Fastify(handlerTimeout === undefined ? {} : { handlerTimeout })
      t.teardown(() => app.close())
      // wait: a duplicate waits up to a second for the original to settle, then claims.
      await app.register(idempotency, { store, scope: () => 'acct', transaction: true, wait: 1000 })
      app.post<{ Body: { fail?: boolean } }>('/pay', async (request, reply) => {
        runs.push(name)
        const key = request.idempotency?.key ?? ''
        await exec(request.idempotency?.sql, `INSERT INTO ${payTable} (key, instance) VALUES ($1, $2)`, [key, name])
        if (name === 'original') await gate
        if (request.body.fail === true) throw new Error('declined')
        return reply.code(201).send({ key, instance: name })
      })
      return app
    }
    const original = await instance('original')
    const timed = await instance('timed', 150)

    const givenBack: DecisionEvent[] = []
    const onDecision = (message: unknown): void => {
      const event = message as DecisionEvent
      if (event.key === 'late' && event.outcome === 'released') givenBack.push(event)
    }
    diagnostics.subscribe(DECISION_CHANNEL, onDecision)
    t.teardown(() => { diagnostics.unsubscribe(DECISION_CHANNEL, onDecision) })

    const first = original.inject({ method: 'POST', url: '/pay', headers: keyed('late'), payload: { fail: true } })
    await sleep(100)
    // Waits for the original's uncommitted claim; handlerTimeout answers it meanwhile.
    const late = await timed.inject({ method: 'POST', url: '/pay', headers: keyed('late'), payload: { fail: true } })
    t.equal(late.statusCode, 503, 'the duplicate was answered by handlerTimeout while its claim waited')
    // The original fails and rolls back: woken, the waiting claim now acquires the key, for a request already answered.
    release()
    t.equal((await first).statusCode, 500)
    // Two keys given back: the original's, released after its handler threw, and the late claim's.
    for (let i = 0; i < 250 && givenBack.length < 2; i++) await sleep(20)
    t.equal(givenBack.length, 2, 'the late claim acquired the key after its request was answered, and gave it back')
    for (let i = 0; i < 100 && store.openTransactions > 0; i++) await sleep(20)
    t.equal(store.openTransactions, 0, 'the late claim\'s transaction was rolled back: none left open')
    t.equal(await idleInTransaction(), 0, 'no connection is left idle in a transaction')
    t.same(runs, ['original'], 'the late claim\'s handler never ran')

    const retry = await original.inject({ method: 'POST', url: '/pay', headers: keyed('late'), payload: { fail: false } })
    t.equal(retry.statusCode, 201, 'the key is free: a retry runs (no 409 from a claim left behind)')
    t.same(await payments('late'), ['original'], 'one payment, the retry\'s')
    await store.close()
  })
}
