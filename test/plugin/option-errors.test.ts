import { inspect } from 'node:util'
import Fastify from 'fastify'
import { Redis } from 'ioredis'
import pg from 'pg'
import postgres from 'postgres'
import t, { type Test } from 'tap'
import { createIdempotentClient, InvalidOptionError as ClientOptionError } from '../../client/index.js'
import { describeValue } from '../../client/describe-value.js'
import idempotency, { InvalidOptionError, memoryStore, type IdempotencyOptions } from '../../lib/index.js'
import { migrate, postgresStore, type PostgresStoreOptions } from '../../drivers/postgres/index.js'
import { redisPrefilter, type RedisPrefilterOptions } from '../../drivers/redis/index.js'

/**
 * An option error names the option and describes the value by its kind, never by its content:
 * a client passed where the other client is expected holds the database password (postgres.js in
 * `options.pass`, node-postgres in its `connectionString`), and the error's message, its
 * `util.inspect` form (an uncaught error's crash output) and its serialized own properties (what
 * pino and crash reporters write) go to logs. None of the clients below connects: each is only
 * handed to an option that refuses it.
 */

const PASSWORDS = ['pjs-secret-5d1f', 'pg-secret-77aa', 'redis-secret-0c3e', 'url-secret-9b2d', 'token-secret-41e0']
const [PJS, PG, REDIS, URL_SECRET, TOKEN] = PASSWORDS as [string, string, string, string, string]

const CONNECTION_STRING = `postgres://alice:${URL_SECRET}@127.0.0.1/payments`
/** How a string is described: by its length. */
const aString = (text: string): string => `a string of ${text.length} characters`

function clients (t: Test): { sql: postgres.Sql, pool: pg.Pool, single: pg.Client, redis: Redis } {
  const sql = postgres(`postgres://alice:${PJS}@127.0.0.1:1/payments`, { max: 1 })
  const pool = new pg.Pool({ connectionString: `postgres://bob:${PG}@127.0.0.1:1/payments` })
  const single = new pg.Client({ connectionString: `postgres://bob:${PG}@127.0.0.1:1/payments` })
  const redis = new Redis(`redis://:${REDIS}@127.0.0.1:1`, { lazyConnect: true })
  t.teardown(async () => {
    await sql.end({ timeout: 1 })
    await pool.end()
    redis.disconnect()
  })
  return { sql, pool, single, redis }
}

/** What a log line or crash report can hold of an error: its message, its inspected form, its serialized own properties. */
function everythingShown (err: Error): string {
  const own: Record<string, unknown> = {}
  for (const name of Object.keys(err)) own[name] = (err as unknown as Record<string, unknown>)[name]
  let serialized: string
  try { serialized = JSON.stringify(own) } catch { serialized = '' }
  return [err.message, err.stack ?? '', inspect(err, { depth: 5 }), serialized].join('\n')
}

function refused (t: Test, err: unknown, option: string, kind: string): void {
  t.type(err, Error, `${option}: refused`)
  if (!(err instanceof Error)) return
  t.ok(err instanceof InvalidOptionError || err instanceof ClientOptionError, `${option}: an InvalidOptionError (${err.name})`)
  t.ok(err.message.includes(`${option} must be`), `${option}: names the option (${err.message})`)
  t.ok(err.message.endsWith(`; received ${kind}`), `${option}: describes the value as ${kind}`)
  const shown = everythingShown(err)
  t.same(PASSWORDS.filter((secret) => shown.includes(secret)), [], `${option}: no secret in the message, the inspected error or its serialized properties`)
}

function thrown (fn: () => unknown): unknown {
  try {
    fn()
    return null
  } catch (err) {
    return err
  }
}

async function registration (t: Test, options: IdempotencyOptions, route?: Record<string, unknown>): Promise<unknown> {
  const app = Fastify()
  t.teardown(() => app.close())
  try {
    await app.register(idempotency, options)
    if (route !== undefined) app.post('/payments', { config: { idempotency: route } }, async () => ({}))
    await app.ready()
    return null
  } catch (err) {
    return err
  }
}

t.test('describeValue names the kind of a value, and shows numbers, booleans, null and undefined as they are', async (t) => {
  const { sql, pool, single, redis } = clients(t)
  t.equal(describeValue(sql), 'a postgres.js client')
  t.equal(describeValue(pool), 'a pg.Pool')
  t.equal(describeValue(single), 'a pg.Client')
  t.equal(describeValue(redis), 'an ioredis Redis client')
  t.equal(describeValue(CONNECTION_STRING), `a string of ${CONNECTION_STRING.length} characters`)
  t.equal(describeValue(''), 'a string of 0 characters')
  t.equal(describeValue('x'), 'a string of 1 character')
  t.equal(describeValue({ connectionString: 'postgres://…' }), 'an object with property connectionString')
  t.equal(describeValue({ [`Bearer ${TOKEN}`]: 1 }), 'an object with 1 property', 'a property name that is not a name is counted, not shown')
  t.equal(describeValue(Buffer.alloc(32)), 'a Buffer of 32 bytes')
  t.equal(describeValue(['a', 'b']), 'an array of 2 items')
  t.equal(describeValue([409, 422]), 'an array of 2 items: 409, 422')
  t.equal(describeValue(new Map()), 'an instance of Map')
  t.equal(describeValue(() => {}), 'a function')
  t.same([0, -1.5, true, false, null, undefined].map(describeValue), ['0', '-1.5', 'true', 'false', 'null', 'undefined'])
})

t.test('the postgres driver: a client where the other is expected, or a connection string, is described, never printed', async (t) => {
  const { sql, pool, single } = clients(t)
  const store = (options: Record<string, unknown>): unknown => thrown(() => postgresStore(options as PostgresStoreOptions))
  refused(t, store({ pool: sql }), 'postgresStore option "pool"', 'a postgres.js client')
  refused(t, store({ sql: pool }), 'postgresStore option "sql"', 'a pg.Pool')
  refused(t, store({ pool: single }), 'postgresStore option "pool"', 'a pg.Client')
  refused(t, store({ sql: CONNECTION_STRING }), 'postgresStore option "sql"', aString(CONNECTION_STRING))
  refused(t, store({ pool: { connectionString: CONNECTION_STRING } }), 'postgresStore option "pool"', 'an object with property connectionString')
  refused(t, store({ sql, pool }), 'postgresStore options', 'an object with properties sql, pool')
  refused(t, store({ sql, schema: `app.${TOKEN}` }), 'postgresStore option "schema"', aString(`app.${TOKEN}`))
  refused(t, store({ sql, onBackgroundError: pool }), 'postgresStore option "onBackgroundError"', 'a pg.Pool')
  refused(t, store({ sql, outbox: pool }), 'postgresStore option "outbox"', 'a pg.Pool')
  refused(t, await migrate(CONNECTION_STRING as never).then(() => null, (err: unknown) => err),
    'migrate: client', aString(CONNECTION_STRING))

  const err = store({ pool: sql }) as InvalidOptionError
  t.equal(err.received, sql, 'the refused value stays on the error for code that handles it')
  t.notOk(Object.keys(err).includes('received'), 'but not as an enumerable property, which serializers write out')
})

t.test('the redis pre-filter and the memory store: the same', async (t) => {
  const { pool, redis } = clients(t)
  const prefilter = (options: Record<string, unknown>): unknown => thrown(() => redisPrefilter(options as unknown as RedisPrefilterOptions))
  refused(t, prefilter({ client: pool }), 'redisPrefilter option "client"', 'a pg.Pool')
  refused(t, prefilter({ client: `redis://:${REDIS}@127.0.0.1:6379` }), 'redisPrefilter option "client"', aString(`redis://:${REDIS}@127.0.0.1:6379`))
  refused(t, prefilter({ client: redis, prefix: `{${TOKEN}}` }), 'redisPrefilter option "prefix"', aString(`{${TOKEN}}`))
  refused(t, thrown(() => memoryStore({ now: pool as never })), 'memoryStore option "now"', 'a pg.Pool')
  refused(t, thrown(() => memoryStore({ maxBytes: TOKEN as never })), 'memoryStore option "maxBytes"', aString(TOKEN))
})

t.test("the plugin's options, at registration and per route: the same", async (t) => {
  const { sql, pool, redis } = clients(t)
  refused(t, await registration(t, { store: pool as never }), 'option "store"', 'a pg.Pool')
  refused(t, await registration(t, { store: sql as never }), 'option "store"', 'a postgres.js client')
  refused(t, await registration(t, { prefilter: redis as never }), 'option "prefilter"', 'an ioredis Redis client')
  refused(t, await registration(t, { metrics: pool as never }), 'option "metrics"', 'a pg.Pool')
  refused(t, await registration(t, { docsUrl: `ftp://user:${URL_SECRET}@docs.example.com` }), 'option "docsUrl"', aString(`ftp://user:${URL_SECRET}@docs.example.com`))
  refused(t, await registration(t, { databaseUrl: CONNECTION_STRING } as never), 'option "databaseUrl"', aString(CONNECTION_STRING))
  refused(t, await registration(t, { scope: () => 'acct', ttl: TOKEN as never }), 'option "ttl"', aString(TOKEN))
  refused(t, await registration(t, { scope: () => 'acct' }, { storeTimeout: pool }), 'route POST /payments config.idempotency.storeTimeout', 'a pg.Pool')
  refused(t, await registration(t, { scope: () => 'acct' }, { record: TOKEN }), 'route POST /payments config.idempotency.record', aString(TOKEN))
})

t.test("the client's options: the same (a base URL or a header value can hold a credential)", async (t) => {
  const client = (options: Record<string, unknown>): unknown => thrown(() => createIdempotentClient(options))
  refused(t, client({ baseUrl: `ftp://user:${URL_SECRET}@api.example.com` }), 'baseUrl', aString(`ftp://user:${URL_SECRET}@api.example.com`))
  refused(t, client({ headers: { authorization: `Bearer ${TOKEN}\r\nx-injected: 1` } }), 'headers["authorization"]', aString(`Bearer ${TOKEN}\r\nx-injected: 1`))
  refused(t, client({ timeoutMs: TOKEN }), 'timeoutMs', aString(TOKEN))
  refused(t, client({ retryStatuses: [409, 422] }), 'retryStatuses', 'an array of 2 items: 409, 422')
  const api = createIdempotentClient({ baseUrl: 'http://127.0.0.1:1', fetch: async () => { throw new Error('nothing is sent') } })
  refused(t, await api.post('/payments', { key: `${TOKEN}\u00e9` }).then(() => null, (err: unknown) => err), 'key', aString(`${TOKEN}\u00e9`))
})
