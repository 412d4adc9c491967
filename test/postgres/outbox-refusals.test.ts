import Fastify from 'fastify'
import pg from 'pg'
import postgres from 'postgres'
import t from 'tap'
import idempotency from '../../lib/index.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The transactional outbox refuses a message it could not deliver as written (a topic that is not
 * a string, a payload that is not JSON) and a transaction that is not one the message can commit
 * with (the application's own client, any other value), on either client, before anything is
 * written; the request's valid messages are still enqueued. A delivery that fails with something
 * other than an Error is kept for a retry with what was thrown as its last error.
 */

const keyed = (key: string): Record<string, string> => ({ 'idempotency-key': `"${key}"`, 'content-type': 'application/json' })

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/outbox-refusals.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const sql = postgres(url, { max: 4, onnotice: () => {} })
  const pool = new pg.Pool({ connectionString: url, max: 2, allowExitOnIdle: true })
  const { name: schema, sql: admin } = postgresSchema(t, url, { prefix: 'idem_outbox_refusals', client: { max: 2 } })
  const stores: PostgresStore[] = []
  t.teardown(async () => {
    for (const store of stores) await store.close()
    await sql.end({ timeout: 2 })
    await pool.end()
  })

  t.test('postgres.js, atomic mode: malformed messages and foreign transactions are refused; a thrown string is kept as the last error', async (t) => {
    const store = postgresStore({
      sql,
      schema,
      table: 'records',
      purgeInterval: 0,
      // A broker client that rejects with a string, not an Error.
      outbox: { retryDelay: 60_000, deliver: () => { throw 'broker down' } } // eslint-disable-line no-throw-literal
    })
    stores.push(store)
    await store.migrate()
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'acct', transaction: true })
    app.post('/order', async (request, reply) => {
      const context = request.idempotency
      if (context === null || context === undefined) throw new Error('unprotected')
      const refused: string[] = []
      const attempt = async (enqueue: () => Promise<void>): Promise<void> => { await enqueue().catch((err: Error) => { refused.push(err.message) }) }
      await attempt(() => context.enqueue({ name: 'topic', topic: 5 as unknown as string, payload: {} }))
      await attempt(() => context.enqueue({ name: 'payload', topic: 'email', payload: undefined }))
      await attempt(() => context.enqueue({ name: 'own-client', topic: 'email', payload: {} }, sql))
      await attempt(() => context.enqueue({ name: 'object', topic: 'email', payload: {} }, {}))
      await context.enqueue({ name: 'receipt', topic: 'email', payload: { to: 'a@example.com' } })
      return reply.code(201).send({ refused })
    })

    const response = await app.inject({ method: 'POST', url: '/order', headers: keyed('order'), payload: {} })
    t.equal(response.statusCode, 201)
    t.match(response.json().refused, [
      "fastify-idempotency: an outbox message's topic must be a string; received number",
      "fastify-idempotency: an outbox message's payload must be a JSON value",
      /enqueue\(\) needs the transaction the message commits with/,
      /enqueue\(\) needs the transaction the message commits with/
    ])
    const outbox = `${schema}.records_outbox`
    let rows: Array<{ name: string, last_error: string | null }> = []
    for (let i = 0; i < 200 && rows[0]?.last_error == null; i++) {
      rows = await admin.unsafe(`SELECT name, last_error FROM ${outbox} ORDER BY name`) as unknown as typeof rows
      await sleep(10)
    }
    t.same(rows, [{ name: 'receipt', last_error: 'broker down' }], 'only the valid message; its failed delivery kept with what was thrown')
    for (const transaction of [null, 'tx']) {
      await t.rejects(store.enqueue(transaction, { scope: 'acct', key: 'direct', name: 'receipt', topic: 'email', payload: {} }),
        { name: 'TypeError', message: /enqueue\(\) needs the transaction the message commits with/ }, `the store's own enqueue(${String(transaction)})`)
    }
  })

  t.test('node-postgres: enqueue() through anything but a transaction\'s handle is refused', async (t) => {
    const store = postgresStore({ pool, schema, table: 'records_pg', purgeInterval: 0, outbox: { deliver: () => {} } })
    stores.push(store)
    await store.migrate()
    const message = { scope: 'acct', key: 'k', name: 'receipt', topic: 'email', payload: {} }
    for (const transaction of [{}, pool, null, 'tx']) {
      await t.rejects(store.enqueue(transaction, message), { name: 'TypeError', message: /enqueue\(\) needs the transaction the message commits with/ }, String(transaction))
    }
    t.equal(Number((await admin.unsafe(`SELECT count(*)::int AS n FROM ${schema}.records_pg_outbox`))[0]?.n), 0, 'nothing was written')
  })
}
