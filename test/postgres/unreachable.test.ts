import Fastify from 'fastify'
import pg from 'pg'
import postgres from 'postgres'
import t from 'tap'
import idempotency from '../../lib/index.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { closedPort } from '../helpers/closed-port.js'

/**
 * A database that refuses connections, on either client and in either mode: the plugin answers the
 * store-unavailable problem (503) and the handler never runs, since the key could not be checked.
 * Options that are not an object are refused when the store is made, before any connection.
 */

t.test('store options that are not an object are refused by name', async (t) => {
  for (const options of [null, 'postgres://localhost/db']) {
    t.throws(() => postgresStore(options as never), { name: 'InvalidOptionError', message: /postgresStore options must be an object with at least \{ sql \} \(postgres\.js\) or \{ pool \} \(node-postgres\)/ })
  }
})

t.test('a database that refuses connections: 503, and the handler never runs', async (t) => {
  const port = await closedPort()
  const sql = postgres({ host: '127.0.0.1', port, database: 'none', username: 'none', connect_timeout: 2, max: 1, onnotice: () => {} })
  const pool = new pg.Pool({ host: '127.0.0.1', port, database: 'none', user: 'none', connectionTimeoutMillis: 2000, max: 1 })
  pool.on('error', () => {})
  const stores: PostgresStore[] = [
    postgresStore({ sql, purgeInterval: 0 }),
    postgresStore({ pool, purgeInterval: 0 })
  ]
  t.teardown(async () => {
    for (const store of stores) await store.close()
    await sql.end({ timeout: 1 })
    await pool.end()
  })
  for (const [client, store] of [['postgres.js', stores[0]], ['node-postgres', stores[1]]] as const) {
    for (const transaction of [false, true]) {
      const app = Fastify()
      t.teardown(() => app.close())
      await app.register(idempotency, { store: store as PostgresStore, scope: () => 'acct', transaction })
      let runs = 0
      app.post('/pay', async () => { runs++; return { ok: true } })
      const response = await app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': '"k"', 'content-type': 'application/json' }, payload: {} })
      const mode = transaction ? 'atomic mode' : 'lease mode'
      t.equal(response.statusCode, 503, `${client}, ${mode}: 503`)
      t.match(response.json(), { type: /store-unavailable$/ }, `${client}, ${mode}: the store-unavailable problem`)
      t.equal(runs, 0, `${client}, ${mode}: the handler did not run`)
    }
  }
})
