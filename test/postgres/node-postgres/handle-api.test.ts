import Fastify, { type FastifyInstance, type FastifyRequest } from 'fastify'
import pg from 'pg'
import t, { type Test } from 'tap'
import idempotency from '../../../lib/index.js'
import type { PostgresStore } from '../../../drivers/postgres/index.js'
import { keyed, nodePostgresWorld, poolClientOf } from '../../helpers/node-postgres-world.js'
import { sleep } from '../../helpers/sleep.js'

/**
 * Atomic mode on node-postgres: `request.idempotency.sql` is the transaction's PoolClient, and
 * takes query() in every form node-postgres does, each answered as node-postgres answers it: a
 * callback in place of the values, a submittable with a callback, a config with a callback or a
 * query_timeout, values that are not an array (node-postgres's own refusal, which fails that query
 * alone), a null query (node-postgres's own throw). Properties other than query() and release()
 * are the client's own. A query still waiting its turn when the handler returns is refused: it
 * would run after the transaction ended.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/node-postgres/handle-api.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const db = nodePostgresWorld(t, url)
  let tables = 0

  async function world (t: Test, route: (client: pg.PoolClient, request: FastifyRequest) => Promise<unknown>): Promise<{ app: FastifyInstance, store: PostgresStore }> {
    const store = await db.store(`records_${++tables}`)
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'acct', transaction: true })
    app.post('/pay', async (request, reply) => reply.code(201).send(await route(poolClientOf(request), request)))
    return { app, store }
  }
  const insert = (key: string, note: string): string => `INSERT INTO ${db.payTable} (key, amount, ref) VALUES ('${key}', 1, '${key}-${note}')`
  const refs = async (key: string): Promise<string[]> =>
    (await db.admin`SELECT ref FROM ${db.admin(db.schema)}.payments WHERE key = ${key} ORDER BY ref`).map((row) => String(row.ref))

  t.test('query() in node-postgres\'s other forms: callbacks, a submittable with a callback, a config with a timeout, values refused by node-postgres', async (t) => {
    const key = 'forms'
    const { app } = await world(t, async (client) => {
      const viaCallback = await new Promise<unknown>((resolve, reject) => {
        client.query(`${insert(key, 'callback')} RETURNING ref`, (err: Error | null, result: pg.QueryResult) => err === null ? resolve(result.rows[0].ref) : reject(err))
      })
      const submittable = new pg.Query(`${insert(key, 'submittable')} RETURNING ref`)
      // node-postgres takes a callback after a submittable too (its typings do not say so).
      const query = client.query.bind(client) as (submittable: pg.Query, callback: (err: Error | null, result: pg.QueryResult) => void) => unknown
      const viaSubmittable = await new Promise<unknown>((resolve, reject) => {
        query(submittable, (err, result) => err === null ? resolve(result.rows[0].ref) : reject(err))
      })
      // Values that are not an array: node-postgres refuses them itself, before sending anything.
      const badValues = await client.query('SELECT $1::text', 'not an array' as never).then(() => 'sent', (err: Error) => err.message)
      let nullQuery = ''
      try { client.query(null as never) } catch (err) { nullQuery = (err as Error).message }
      // A config carrying its own callback: answered through it.
      const viaConfigCallback = await new Promise<unknown>((resolve, reject) => {
        void client.query({ text: `${insert(key, 'config callback')} RETURNING ref`, callback: (err: Error | null, result: pg.QueryResult) => err === null ? resolve(result.rows[0].ref) : reject(err) } as pg.QueryConfig)
      })
      // A config with a query_timeout: the timeout goes with the query the guard builds.
      await client.query({ text: insert(key, 'config'), query_timeout: 10_000 } as pg.QueryConfig)
      await client.query(insert(key, 'after'))
      return { viaCallback, viaSubmittable, viaConfigCallback, badValues, nullQuery, escaped: client.escapeIdentifier('a"b'), processID: typeof (client as unknown as { processID: unknown }).processID }
    })
    const response = await app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: {} })
    t.equal(response.statusCode, 201)
    const body = response.json()
    t.equal(body.viaCallback, `${key}-callback`)
    t.equal(body.viaSubmittable, `${key}-submittable`)
    t.equal(body.viaConfigCallback, `${key}-config callback`)
    t.equal(body.escaped, '"a""b"', 'the client\'s own methods work through the handle')
    t.not(body.badValues, 'sent', 'node-postgres\'s own refusal')
    t.match(body.nullQuery, /null or undefined query/)
    t.equal(body.processID, 'number', 'the client\'s own properties read through')
    t.same(await refs(key), [`${key}-after`, `${key}-callback`, `${key}-config`, `${key}-config callback`, `${key}-submittable`], 'all committed with the response')
  })

  t.test('a query still waiting its turn when the handler returns is refused; the one in flight runs in the transaction', async (t) => {
    const key = 'waiting'
    let late: Promise<unknown> = Promise.resolve()
    const { app } = await world(t, async (client) => {
      void client.query('SELECT pg_sleep(0.05)').catch(() => {})
      // node-postgres's client sends one query at a time; the guard keeps this one until the sleep is answered.
      late = client.query(insert(key, 'late')).then(() => 'sent', (err: Error) => err.message)
      return {}
    })
    t.equal((await app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: {} })).statusCode, 201)
    t.match(await late, /transaction has ended/)
    await sleep(50)
    t.same(await refs(key), [], 'the late insert never ran')
  })
}
