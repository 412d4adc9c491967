import Fastify from 'fastify'
import t from 'tap'
import idempotency from '../../lib/index.js'
import { postgresStore } from '../../drivers/postgres/index.js'
import { postgresSchema } from '../helpers/postgres-schema.js'

/**
 * What atomic mode sends for a fresh key, read off the wire (postgres.js `debug`): BEGIN, the
 * claim, the handler's own statements, the recorded response, COMMIT. The claim waits for no other
 * transaction (it tries the key's advisory lock) and sets the mark a guarded handle's probe reads
 * in the same statement, so there is no lock_timeout to set and reset around it, and no statement
 * of its own for the mark; the handler's statements run with the server's settings.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/atomic-statements.test.ts`.')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const sent: string[] = []
  const { name: schema, sql } = postgresSchema(t, url, { prefix: 'idem_atomic_statements', client: { max: 4, debug: (_connection, query) => { sent.push(query.replace(/\s+/g, ' ').trim()) } } })

  t.test('a fresh key: BEGIN, the claim, the handler\'s statement, the recorded response, COMMIT', async (t) => {
    const store = postgresStore({ sql, schema, table: 'records', purgeInterval: 0 })
    await store.migrate()
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'test', transaction: true })
    let inHandler: { lockTimeout: string, mark: string } | null = null
    app.post('/pay', async (request) => {
      const tx = request.idempotency?.sql
      if (tx === undefined) throw new Error('no transaction')
      const [row] = await tx`SELECT current_setting('lock_timeout') AS lock_timeout, current_setting('fastify_idempotency.transaction', true) AS mark`
      inHandler = { lockTimeout: String(row?.lock_timeout), mark: String(row?.mark) }
      return { ok: true }
    })
    const pay = (key: string) => app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': `"${key}"`, 'content-type': 'application/json' }, payload: {} })
    // The first request checks the table's shape, once.
    t.equal((await pay('k0')).statusCode, 200)
    sent.length = 0
    t.equal((await pay('k1')).statusCode, 200)
    const kinds = sent.map((query) =>
      /^begin$/i.test(query)
        ? 'BEGIN'
        : /^commit$/i.test(query)
          ? 'COMMIT'
          : /pg_try_advisory_xact_lock/.test(query)
            ? 'claim'
            : /^UPDATE .* SET state = 'completed'/.test(query)
              ? 'record'
              : /current_setting\('lock_timeout'\)/.test(query) ? 'handler' : query)
    t.same(kinds, ['BEGIN', 'claim', 'handler', 'record', 'COMMIT'], 'five statements, no other')
    t.notOk(sent.some((query) => /lock_timeout =|set local/i.test(query)), 'no SET of its own')
    t.same(inHandler, { lockTimeout: '0', mark: 'open' }, "the handler runs with the server's lock_timeout, in the marked transaction")
  })

  t.test('a duplicate of a claim in flight elsewhere: BEGIN, the claim, ROLLBACK, answered at once', async (t) => {
    const store = postgresStore({ sql, schema, table: 'records', purgeInterval: 0 })
    const other = postgresStore({ sql, schema, table: 'records', purgeInterval: 0 })
    const request = { scope: 'test', key: 'k2', fingerprint: { algorithm: 'test', digest: Buffer.alloc(32, 2) }, leaseMs: 1_000, ttlMs: 60_000 }
    const holding = await other.claimInTransaction(request)
    if (holding.outcome !== 'acquired') return t.fail('not acquired')
    sent.length = 0
    const started = Date.now()
    t.match(await store.claimInTransaction(request), { outcome: 'in_progress', unseen: true })
    t.ok(Date.now() - started < 1_000, 'not blocked on the holder')
    for (let i = 0; i < 200 && store.openTransactions > 0; i++) await new Promise((resolve) => setTimeout(resolve, 5))
    // A new connection first reads the server's types (postgres.js fetch_types).
    const statements = sent.filter((query) => !/pg_catalog/.test(query)).map((query) => query.slice(0, 30))
    t.same(statements.map((query) => query.toLowerCase().split(' ')[0]), ['begin', 'with', 'rollback'], `BEGIN, the claim, ROLLBACK: ${JSON.stringify(statements)}`)
    t.equal(await other.release(holding.lease), true)
  })

  t.test('a claim that did not acquire answers once its transaction has ended: the caller\'s next claim never meets its lock', async (t) => {
    const store = postgresStore({ sql, schema, table: 'records', purgeInterval: 0 })
    const recorded = { algorithm: 'test', digest: Buffer.alloc(32, 7) }
    // The same request's fingerprint as the client now spells it: another algorithm, so the plugin
    // claims once more with the record's spelling (a key rotation), at once.
    const respelled = { algorithm: 'test-next', digest: Buffer.alloc(32, 8) }
    const keys = Array.from({ length: 20 }, (_, i) => `rotated-${i}`)
    for (const key of keys) {
      const owner = await store.claim({ scope: 'test', key, fingerprint: recorded, leaseMs: 1, ttlMs: 60_000 })
      if (owner.outcome !== 'acquired') return t.fail(`${key}: not acquired`)
    }
    await new Promise((resolve) => setTimeout(resolve, 20)) // every lease lapsed
    for (const key of keys) {
      const first = await store.claimInTransaction({ scope: 'test', key, fingerprint: respelled, leaseMs: 1_000, ttlMs: 60_000 })
      t.match(first, { outcome: 'in_progress', fingerprint: recorded }, `${key}: the record's fingerprint, not a takeover`)
      t.equal(store.openTransactions, 0, `${key}: answered with its transaction ended`)
      const second = await store.claimInTransaction({ scope: 'test', key, fingerprint: recorded, leaseMs: 1_000, ttlMs: 60_000 })
      t.match(second, { outcome: 'acquired', takeover: true }, `${key}: the next claim takes the lapsed record over`)
      if (second.outcome === 'acquired') t.equal(await store.release(second.lease), true)
    }
  })
}
