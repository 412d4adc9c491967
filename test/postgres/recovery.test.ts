import Fastify from 'fastify'
import pg from 'pg'
import postgres from 'postgres'
import t from 'tap'
import idempotency, { LeaseLostError } from '../../lib/index.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { recoveryScenarios } from '../helpers/recovery-scenarios.js'
import { CLIENT, endPools, exec, storeConnection } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Recovery points, indeterminate failures, the reconciler and the operator tools on Postgres: the
 * shared scenarios (also run on the memory store), then what only Postgres has: transactional
 * steps, the reconciler's advisory lock, and the upgrade of a table created before these columns.
 * The store runs on the client under test (test/helpers/postgres-clients.ts; the node-postgres run:
 * test/postgres/node-postgres/recovery.test.ts); the suite's own reads stay on postgres.js.
 * A transactional step's `fn` gets that client's transaction handle (a guarded TransactionSql or
 * PoolClient), so the steps here write through `exec`, which runs `$n` SQL on either.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/recovery.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const { name: schema, sql } = postgresSchema(t, url, { prefix: 'idem_recovery', client: { max: 10 } })
  const stores: PostgresStore[] = []
  let tables = 0

  t.teardown(async () => {
    for (const store of stores) await store.close()
    await endPools()
  })

  /** The schema, quoted for SQL text run through `exec` (its name is [a-z0-9_], see above). */
  const inSchema = (table: string): string => `"${schema}".${table}`

  async function freshStore (): Promise<PostgresStore> {
    const store = postgresStore({ ...storeConnection(sql), schema, table: `records_${++tables}`, purgeInterval: 0 })
    await store.migrate()
    stores.push(store)
    return store
  }

  // Real time on the database clock: a short lease, and sleeps a little past it.
  recoveryScenarios(t, {
    store: freshStore,
    lease: 300,
    lapse: async (ms) => { await sleep(ms + 20) }
  })

  t.test('transactional step: its writes and its record commit together, or neither does', async (t) => {
    const store = await freshStore()
    await sql`CREATE TABLE ${sql(schema)}.reservations (key text, note text)`
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'acct_a', lease: 300 })
    let failInside = false
    let runs = 0
    app.post('/reserve', async (request) => {
      const context = request.idempotency
      if (context === null) throw new Error('unprotected')
      const reservation = await context.step('reserve', async (tx) => {
        runs++
        await exec(tx, `INSERT INTO ${inSchema('reservations')} VALUES ($1, $2)`, [context.key, `run ${runs}`])
        if (failInside) throw new Error('failed inside the step')
        return { reserved: runs }
      }, { transaction: true })
      return { reservation }
    })
    const reserve = (key: string) => app.inject({ method: 'POST', url: '/reserve', headers: { 'idempotency-key': `"${key}"` } })

    const ok = await reserve('r1')
    t.same(ok.json(), { reservation: { reserved: 1 } })
    t.same(await sql`SELECT note FROM ${sql(schema)}.reservations WHERE key = 'r1'`, [{ note: 'run 1' }])
    t.same((await store.inspect({ scope: 'acct_a', key: 'r1' }))?.steps, { reserve: { reserved: 1 } })

    failInside = true
    t.equal((await reserve('r2')).statusCode, 500)
    t.same(await sql`SELECT note FROM ${sql(schema)}.reservations WHERE key = 'r2'`, [], 'the failed step\'s write rolled back')
    t.equal(await store.inspect({ scope: 'acct_a', key: 'r2' }), null, 'no step completed, so a definite failure: released')
    failInside = false
    t.same((await reserve('r2')).json(), { reservation: { reserved: 3 } }, 'the retry ran the step again, once')
    t.same(await sql`SELECT note FROM ${sql(schema)}.reservations WHERE key = 'r2'`, [{ note: 'run 3' }])
  })

  t.test('transactional step of an owner that lost its key: rolled back, LeaseLostError', async (t) => {
    const store = await freshStore()
    await sql`CREATE TABLE ${sql(schema)}.lost_writes (key text)`
    const claim = await store.claim({ scope: 'acct_a', key: 'lost', fingerprint: { algorithm: 'custom-v1', digest: Buffer.from('x') }, leaseMs: 60_000, ttlMs: 60_000 })
    if (claim.outcome !== 'acquired') throw new Error('claim')
    await store.forceRelease({ scope: 'acct_a', key: 'lost' })
    const saved = await store.runStepInTransaction(claim.lease, 'write', async (tx) => {
      await exec(tx, `INSERT INTO ${inSchema('lost_writes')} VALUES ('lost')`)
      return 1
    }, JSON.stringify)
    t.equal(saved, null, 'not recorded')
    t.same(await sql`SELECT * FROM ${sql(schema)}.lost_writes`, [], 'its write rolled back with it')
    t.equal(new LeaseLostError('write').code, 'FST_IDEMPOTENCY_LEASE_LOST')
  })

  t.test('step() in atomic mode is refused: the request transaction is the unit of recovery', async (t) => {
    const store = await freshStore()
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'acct_a', transaction: true })
    let message = ''
    app.setErrorHandler((error, _request, reply) => { message = (error as Error).message; return reply.code(500).send() })
    app.post('/atomic', async (request) => { await request.idempotency?.step('x', () => 1); return {} })
    t.equal((await app.inject({ method: 'POST', url: '/atomic', headers: { 'idempotency-key': '"a"' } })).statusCode, 500)
    t.match(message, /atomic mode/)
    t.equal(store.openTransactions, 0)
  })

  t.test('startReconciler in several instances: one pass at a time (advisory lock)', async (t) => {
    const store = await freshStore()
    const fingerprint = { algorithm: 'custom-v1', digest: Buffer.from('x') }
    for (let i = 0; i < 6; i++) {
      const claim = await store.claim({ scope: 'acct_a', key: `stuck-${i}`, fingerprint, leaseMs: 1, ttlMs: 60_000 })
      if (claim.outcome === 'acquired') await store.hold(claim.lease)
    }
    let running = 0
    let most = 0
    let resolved = 0
    const resolve = async (): Promise<{ action: 'complete', response: { statusCode: number } }> => {
      running++
      most = Math.max(most, running)
      await sleep(20)
      running--
      resolved++
      return { action: 'complete', response: { statusCode: 204 } }
    }
    // Three "instances": three stores on three clients, each with its own reconciler.
    // fetch_types: false, as the README recommends: with it, postgres.js 3.4.9's sql.reserve() never
    // resolves (porsager/postgres#751), which an earlier reconciler lock relied on.
    const others = [postgres(url, { max: 2, fetch_types: false, onnotice: () => {} }), postgres(url, { max: 2, fetch_types: false, onnotice: () => {} })]
    const instances = [store, ...others.map((client) => postgresStore({ ...storeConnection(client), schema, table: `records_${tables}`, purgeInterval: 0 }))]
    const reconcilers = instances.map((instance) => instance.startReconciler({ interval: 5, olderThan: 0, limit: 2, resolve }))
    const deadline = Date.now() + 10_000
    while (resolved < 6 && Date.now() < deadline) await sleep(10)
    await Promise.all(reconcilers.map((reconciler) => reconciler.stop()))
    for (const instance of instances.slice(1)) await instance.close()
    await Promise.all(others.map((client) => client.end({ timeout: 1 })))
    t.equal(resolved, 6, 'every stuck record resolved once')
    if (CLIENT === 'postgres') {
      const single = postgres(url, { max: 1, onnotice: () => {} })
      t.throws(() => postgresStore({ sql: single, schema, purgeInterval: 0 }).startReconciler({ resolve: () => undefined }), { message: /at least 2 connections/ })
      await single.end({ timeout: 1 })
    } else {
      // The same refusal on a node-postgres pool of one connection, named for what the user passed.
      const single = new pg.Pool({ connectionString: url, max: 1 })
      t.throws(() => postgresStore({ pool: single, schema, purgeInterval: 0 }).startReconciler({ resolve: () => undefined }),
        { name: 'TypeError', message: /startReconciler needs a node-postgres pool with at least 2 connections \(max: 1\)/ })
      await single.end()
    }
    t.equal(most, 1, 'never two passes at once')
    const left = await sql`SELECT count(*)::int AS n FROM ${sql(schema)}.${sql(`records_${tables}`)} WHERE state = 'in_progress'`
    t.equal(left[0]?.n, 0)
  })

  t.test('migrate upgrades a table created before steps and indeterminate existed', async (t) => {
    const table = 'records_legacy'
    await sql`
      CREATE TABLE ${sql(schema)}.${sql(table)} (
        scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, fingerprint bytea NOT NULL,
        fingerprint_algorithm text NOT NULL, state text NOT NULL CHECK (state IN ('in_progress', 'completed')),
        owner_token uuid NOT NULL, lease_expires_at timestamptz, response_status integer, response_headers jsonb,
        response_body bytea, created_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz NOT NULL,
        PRIMARY KEY (scope, key))`
    await sql`INSERT INTO ${sql(schema)}.${sql(table)} (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, lease_expires_at, expires_at)
      VALUES ('acct_a', 'old', '\\x00', 'custom-v1', 'in_progress', gen_random_uuid(), now(), now() + interval '1 hour')`
    const store = postgresStore({ ...storeConnection(sql), schema, table, purgeInterval: 0 })
    stores.push(store)
    await store.migrate()
    const record = await store.inspect({ scope: 'acct_a', key: 'old' })
    t.same([record?.state, record?.indeterminate, record?.steps], ['in_progress', false, {}], 'the old row got the defaults')
    const report = await store.reconcile({ olderThan: 0, resolve: () => ({ action: 'release' }) })
    t.match(report, { examined: 1, released: 1 })
  })
}
