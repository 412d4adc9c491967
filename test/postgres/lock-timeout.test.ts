import Fastify from 'fastify'
import t from 'tap'
import idempotency from '../../lib/index.js'
import { postgresStore } from '../../drivers/postgres/index.js'
import { postgresSchema } from '../helpers/postgres-schema.js'

/**
 * Atomic mode bounds a duplicate's wait on an uncommitted claim with `lock_timeout`. The form of the
 * statement matters beyond plain PostgreSQL: Citus forwards `SET LOCAL` to the workers that hold the
 * row (citus.propagate_set_commands = 'local') and never a `set_config()` call, so only SET LOCAL
 * bounds the wait there. This reads what the driver actually sends (postgres.js `debug`).
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/lock-timeout.test.ts`.')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const sent: string[] = []
  const { name: schema, sql } = postgresSchema(t, url, { prefix: 'idem_lock', client: { max: 4, debug: (_connection, query) => { sent.push(query) } } })

  t.test('the wait bound is a SET LOCAL with an integer, reset to the default before the handler runs', async (t) => {
    const store = postgresStore({ sql, schema, table: 'records', purgeInterval: 0 })
    await store.migrate()
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'test', transaction: true, wait: 250 })
    let timeoutInHandler = ''
    app.post('/pay', async (request) => {
      const tx = request.idempotency?.sql
      if (tx === undefined) throw new Error('no transaction')
      timeoutInHandler = String((await tx`SHOW lock_timeout`)[0]?.lock_timeout)
      return { ok: true }
    })
    sent.length = 0
    const res = await app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': '"k1"', 'content-type': 'application/json' }, payload: {} })
    t.equal(res.statusCode, 200)
    const bounds = sent.filter((query) => /lock_timeout/i.test(query))
    t.ok(bounds.some((query) => /^set local lock_timeout = \d+$/.test(query)), `a SET LOCAL with an integer was sent: ${JSON.stringify(bounds)}`)
    t.notOk(sent.some((query) => /set_config/i.test(query)), 'no set_config() call')
    t.equal(timeoutInHandler, '0', "the handler's own statements run with the server's lock_timeout")
  })
}
