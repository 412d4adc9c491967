import { randomBytes } from 'node:crypto'
import Fastify from 'fastify'
import pg from 'pg'
import postgres from 'postgres'
import t, { type Test } from 'tap'
import idempotency, { StoreNotReadyError, type IdempotencyStore } from '../../lib/index.js'
import { postgresStore, type PostgresStore, type PostgresStoreOptions } from '../../drivers/postgres/index.js'
import { keyed } from '../helpers/app.js'

/**
 * A database without the store's tables (or with an earlier version's) fails the boot with an
 * error that says to run migrate(), on both clients, instead of booting an app whose every
 * protected request answers 503 while Fastify's default `logger: false` prints nothing. A database
 * that cannot be reached at boot is no reason to refuse to boot: a coded warning says so.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/schema-check.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

type Connection = Pick<PostgresStoreOptions, 'sql' | 'pool'>

/** Every process warning with `code` emitted while the test runs. */
function warnings (t: Test, code: string): () => Promise<Error[]> {
  const seen: Error[] = []
  const listener = (warning: Error & { code?: string }): void => { if (warning.code === code) seen.push(warning) }
  process.on('warning', listener)
  t.teardown(() => { process.off('warning', listener) })
  return async () => { await new Promise((resolve) => setImmediate(resolve)); return seen }
}

function suite (url: string): void {
  const admin = postgres(url, { max: 2, onnotice: () => {} })
  const sql = postgres(url, { max: 4, onnotice: () => {}, fetch_types: false })
  const pool = new pg.Pool({ connectionString: url, max: 4 })
  const schemas: string[] = []
  t.teardown(async () => {
    for (const schema of schemas) await admin`DROP SCHEMA IF EXISTS ${admin(schema)} CASCADE`
    await Promise.all([admin.end({ timeout: 5 }), sql.end({ timeout: 5 }), pool.end()])
  })

  /** A schema name of this test's own; created only by what the test does (migrate() creates it). */
  function freshSchema (): string {
    const schema = `idem_check_${randomBytes(4).toString('hex')}`
    schemas.push(schema)
    return schema
  }

  async function boot (t: Test, store: IdempotencyStore): Promise<unknown> {
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'acct' })
    app.post('/payments', async (_request, reply) => reply.code(201).send({ charged: true }))
    return await app.ready().then(async () => {
      const answer = await app.inject({ method: 'POST', url: '/payments', headers: keyed('check-1'), payload: {} })
      return answer.statusCode
    }, (err: unknown) => err)
  }

  const clients: Array<[string, Connection]> = [['postgres.js', { sql }], ['node-postgres', { pool }]]
  for (const [name, connection] of clients) {
    t.test(`${name}: a schema without the tables fails ready() naming migrate(); after migrate(), ready() resolves and requests are served`, async (t) => {
      const schema = freshSchema()
      const store = postgresStore({ ...connection, schema, purgeInterval: 0 })
      t.teardown(() => store.close())
      const err = await boot(t, store)
      t.type(err, StoreNotReadyError)
      t.match(err, {
        code: 'FST_IDEMPOTENCY_STORE_NOT_READY',
        message: `fastify-idempotency: the idempotency tables are missing in schema "${schema}" (no table "idempotency_records"): ` +
          'run migrate() (or the SQL in fastify-idempotency/postgres/schema.sql) before serving'
      })
      await store.migrate()
      t.equal(await boot(t, store), 201, 'migrated: the app boots and executes')
    })

    t.test(`${name}: a table created by an earlier version (without steps and indeterminate) fails ready(), naming the columns`, async (t) => {
      const schema = freshSchema()
      const store = postgresStore({ ...connection, schema, table: 'records', purgeInterval: 0 })
      t.teardown(() => store.close())
      await store.migrate()
      await admin`ALTER TABLE ${admin(schema)}.records DROP COLUMN steps, DROP COLUMN indeterminate`
      const err = await boot(t, store)
      t.type(err, StoreNotReadyError)
      t.match((err as Error).message, `the table "records" in schema "${schema}" lacks the columns steps, indeterminate`)
      t.match((err as Error).message, /run migrate\(\)/)
      await store.migrate()
      t.equal(await boot(t, store), 201, 'migrate() upgrades it, and the app boots')
    })

    t.test(`${name}: a store with an outbox needs the outbox table too`, async (t) => {
      const schema = freshSchema()
      const store = postgresStore({ ...connection, schema, purgeInterval: 0, outbox: { deliver: () => {} } })
      t.teardown(() => store.close())
      await store.migrate()
      await admin`DROP TABLE ${admin(schema)}.idempotency_records_outbox`
      const err = await boot(t, store)
      t.match(err, { code: 'FST_IDEMPOTENCY_STORE_NOT_READY', message: /the outbox table "idempotency_records_outbox" is missing in schema ".*" \(the store has an outbox\): run migrate\(\)/ })
      const plain = postgresStore({ ...connection, schema, purgeInterval: 0 })
      t.teardown(() => plain.close())
      t.equal(await boot(t, plain), 201, 'a store without an outbox does not need it')
    })
  }

  t.test('a wrapped store (a Proxy, a spread copy) is checked through the wrapper', async (t) => {
    const schema = freshSchema()
    const store = postgresStore({ sql, schema, purgeInterval: 0 })
    t.teardown(() => store.close())
    const calls: PropertyKey[] = []
    const proxy = new Proxy(store, {
      get (target, property, receiver) {
        if (property === 'check') calls.push(property)
        return Reflect.get(target, property, receiver) as unknown
      }
    })
    const spread: PostgresStore = { ...store }
    t.match(await boot(t, proxy), { code: 'FST_IDEMPOTENCY_STORE_NOT_READY' }, 'the Proxy: refused')
    t.ok(calls.length > 0, 'the check went through the Proxy')
    t.match(await boot(t, spread), { code: 'FST_IDEMPOTENCY_STORE_NOT_READY' }, 'the spread copy: refused')
    await store.migrate()
    t.equal(await boot(t, proxy), 201)
    t.equal(await boot(t, spread), 201)
  })

  t.test('a database that cannot be reached at boot: the app boots, with one coded warning per registration', async (t) => {
    const seen = warnings(t, 'FST_IDEMPOTENCY_STORE_UNCHECKED')
    // Port 1 refuses connections: the check fails as every request would (503).
    const unreachable = postgres('postgres://idem:idem@127.0.0.1:1/idem', { max: 1, connect_timeout: 2, fetch_types: false })
    t.teardown(() => unreachable.end({ timeout: 1 }))
    const store = postgresStore({ sql: unreachable, purgeInterval: 0 })
    t.teardown(() => store.close())
    t.equal(await boot(t, store), 503, 'boots; the request gets the store failure')
    const list = await seen()
    t.equal(list.length, 1, 'one warning')
    t.match(list[0], { name: 'FastifyIdempotencyWarning', message: /the store could not be checked at boot \(.+\); protected requests answer 503 while it fails/ })
  })

  t.test('a check slower than storeTimeout does not hold the boot: it warns', async (t) => {
    const seen = warnings(t, 'FST_IDEMPOTENCY_STORE_UNCHECKED')
    const schema = freshSchema()
    const store = postgresStore({ sql, schema, purgeInterval: 0 })
    t.teardown(() => store.close())
    await store.migrate()
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store: { ...store, check: async () => await new Promise<void>(() => {}) }, scope: () => 'acct', storeTimeout: 50 })
    await app.ready()
    t.match((await seen())[0]?.message, /could not be checked at boot \(store\.check\(\) did not answer within 50 ms\)/)
  })
}
