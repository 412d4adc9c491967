import assert from 'node:assert/strict'
import fc from 'fast-check'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import { redisPrefilter, type RedisPrefilter } from '../../drivers/redis/index.js'
import { recordKey } from '../../drivers/redis/keys.js'
import idempotency, { memoryStore } from '../../lib/index.js'
import type { IdempotencyStore } from '../../lib/core/store.js'
import { postgresFixture, redisFixture, type RedisFixture } from './services.js'
import { errorLog, fcParams } from './support.js'
import { sleep } from '../helpers/sleep.js'

/*
 * Hostile content through every storage path: keys (any sf-string: quotes, backslashes, SQL and Lua
 * metacharacters), scopes (any string the app's scope function returns: astral, combining, quotes),
 * response bodies (any bytes: NUL, invalid UTF-8) and replayable headers. Each is stored and
 * replayed byte for byte on the memory store, PostgreSQL, and PostgreSQL behind the Redis
 * pre-filter (the replay then served by Redis), and nothing escapes: the table, the other records
 * and the Redis keyspace are as they were.
 */

const SQL_KEYS = ["'; DROP TABLE storage; --", "x' OR '1'='1", '$1', '$1::text', '-- comment', '/* c */', '$$body$$', "E'\\x00'", '; SELECT pg_sleep(10);']
const LUA_KEYS = [']]', '[[', ']=]', '%s%d%%', '%00', '\\0', "redis.call('FLUSHALL')", 'KEYS[1]', '{tag}', '}{', '\\"']
const QUOTING_KEYS = ['"', '\\', '\\\\"', "'", '`', 'a;b=1', 'a, b', ' leading and trailing ']
const printable = fc.integer({ min: 0x20, max: 0x7e }).map((code) => String.fromCharCode(code))
const keyText = fc.oneof(fc.constantFrom(...SQL_KEYS, ...LUA_KEYS, ...QUOTING_KEYS), fc.string({ unit: printable, minLength: 1, maxLength: 60 }))

/** Scopes: whatever the application's scope function returns. NUL and lone surrogates are in their own tests. */
const TRICKY_SCOPES = ['tenant', '😀', 'e\u0301', 'é', "o'brien", '"quoted"', 'back\\slash', ']]', '%', "'; DROP TABLE storage; --", '']
const scopeText = fc.oneof(fc.constantFrom(...TRICKY_SCOPES), fc.string({ unit: 'grapheme', maxLength: 12 }))

/** Header values Node lets a handler set: latin1 without controls. */
const headerText = fc.string({ unit: fc.oneof(printable, fc.constantFrom('é', 'ÿ', '\t')), maxLength: 40 }).map((s) => s.trim())

const responseSpec = fc.record({
  status: fc.constantFrom(200, 201, 202, 400, 404, 409, 418, 422),
  body: fc.oneof(
    fc.uint8Array({ maxLength: 300 }).map((bytes) => ({ type: 'application/octet-stream', bytes: Buffer.from(bytes) })),
    fc.constantFrom(Buffer.from([0, 0xff, 0xfe, 0x5d, 0x5d, 0x27, 0x00]), Buffer.from(']]\u0000%\'"\\', 'utf8'))
      .map((bytes) => ({ type: 'application/octet-stream', bytes })),
    fc.string({ unit: 'grapheme', maxLength: 40 }).map((text) => ({ type: 'application/json; charset=utf-8', bytes: Buffer.from(JSON.stringify({ text })) }))
  ),
  location: headerText,
  disposition: fc.string({ unit: printable, maxLength: 20 }).map((name) => `attachment; filename="${name.replace(/["\\]/g, '\\$&')}"`),
  links: fc.array(headerText.map((target) => `<${target}>; rel="next"`), { minLength: 2, maxLength: 3 })
})
type ResponseSpec = typeof responseSpec extends fc.Arbitrary<infer T> ? T : never

const quote = (key: string): string => `"${key.replace(/[\\"]/g, (c) => `\\${c}`)}"`

interface StorageApp {
  readonly app: FastifyInstance
  readonly runs: Map<string, number>
  readonly specs: Map<string, ResponseSpec>
  readonly errors: string[]
  setScope: (scope: string) => void
}

async function storageApp (t: Test, store: IdempotencyStore, prefilter?: RedisPrefilter): Promise<StorageApp> {
  const log = errorLog()
  const app = Fastify({ logger: log.logger })
  t.teardown(() => app.close())
  let scope = 'tenant'
  // '' is among the scopes stored apart here, so the app asks for it (the plugin refuses it by default).
  await app.register(idempotency, { store, prefilter, scope: () => scope, allowEmptyScope: true })
  const runs = new Map<string, number>()
  const specs = new Map<string, ResponseSpec>()
  app.post('/files', async (request, reply) => {
    const key = request.idempotency?.key ?? ''
    const id = `${scope}\u0001${key}`
    runs.set(id, (runs.get(id) ?? 0) + 1)
    const spec = specs.get(id)
    if (spec === undefined) throw new Error('no response spec for this key')
    return reply.code(spec.status).type(spec.body.type).header('location', spec.location)
      .header('content-disposition', spec.disposition).header('link', spec.links).send(spec.body.bytes)
  })
  return { app, runs, specs, errors: log.lines, setScope: (s) => { scope = s } }
}

const post = (app: FastifyInstance, key: string, note: string): Promise<LightMyRequestResponse> =>
  app.inject({ method: 'POST', url: '/files', headers: { 'idempotency-key': quote(key), 'content-type': 'application/json' }, payload: { note } })

/** Waits (bounded) until the pre-filter holds the completed copy of the record. */
async function copiedToRedis (redis: RedisFixture, scope: string, key: string): Promise<void> {
  const name = recordKey(redis.prefix, { scope, key })
  for (let i = 0; i < 200; i++) {
    if ((await redis.client.hget(name, 'state')) === 'completed') return
    await sleep(5)
  }
  assert.fail(`the record of ${JSON.stringify(key)} never reached Redis`)
}

/**
 * The property: a first request executes and its response is recorded; its retry gets the same
 * status, bytes and replayable headers, without a second execution. With `redis`, the retry must
 * be a pre-filter hit.
 */
async function byteExactProperty (t: Test, h: StorageApp, numRuns: number, redis?: { fixture: RedisFixture, prefilter: RedisPrefilter }): Promise<string[]> {
  let run = 0
  const used: string[] = []
  await fc.assert(fc.asyncProperty(scopeText, keyText, responseSpec, fc.string({ unit: 'grapheme', maxLength: 20 }), async (scope, hostile, spec, note) => {
    // A fresh key per run (the hostile text kept whole), so every first request is an execution.
    const key = `${hostile}#${run++}`
    const id = `${scope}\u0001${key}`
    h.setScope(scope)
    h.specs.set(id, spec)
    used.push(id)
    const first = await post(h.app, key, note)
    assert.equal(first.statusCode, spec.status, `first: ${first.body.slice(0, 200)}`)
    assert.ok(first.rawPayload.equals(spec.body.bytes), 'the original carries the handler\'s bytes')
    const hitsBefore = redis?.prefilter.stats.hits ?? 0
    if (redis !== undefined) await copiedToRedis(redis.fixture, scope, key)

    const retry = await post(h.app, key, note)
    assert.equal(retry.headers['idempotent-replayed'], 'true', 'the retry is a replay')
    assert.equal(retry.statusCode, spec.status, 'the recorded status')
    assert.ok(retry.rawPayload.equals(spec.body.bytes), `the recorded bytes, exactly (${retry.rawPayload.toString('hex').slice(0, 80)})`)
    for (const name of ['content-type', 'location', 'content-disposition', 'link']) {
      assert.deepEqual(retry.headers[name], first.headers[name], `the ${name} header`)
    }
    assert.equal(h.runs.get(id), 1, 'one execution')
    if (redis !== undefined) assert.equal(redis.prefilter.stats.hits, hitsBefore + 1, 'the replay came from Redis')
  }), fcParams(0x0b17e, numRuns))
  t.same(h.errors, [], 'nothing was logged at error level')
  return used
}

t.test('memory store: hostile keys, scopes and bodies are replayed byte for byte; NUL and lone surrogates in scopes are refused', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const h = await storageApp(t, store)
  const used = await byteExactProperty(t, h, 150)
  t.equal(h.runs.size, used.length, 'one execution per key')

  // Scopes no text column can keep apart (NUL, lone surrogates: postgres-scope-text.test.ts) are
  // refused by the plugin before any store, so a scope function behaves the same on every driver.
  const runsBefore = h.runs.size
  for (const scope of ['a\u0000b', '\ud800', '\udbff']) {
    h.setScope(scope)
    t.equal((await post(h.app, 'same-key', 'n')).statusCode, 500, `${JSON.stringify(scope)}: refused`)
  }
  t.equal(h.runs.size, runsBefore, 'no refused scope ran the handler')
  h.errors.length = 0
  for (const scope of ['a', '\ufffd', 'a\u0001b', '\u{1F600}']) {
    h.setScope(scope)
    h.specs.set(`${scope}\u0001same-key`, { status: 201, body: { type: 'text/plain', bytes: Buffer.from(scope, 'utf16le') }, location: 'x', disposition: 'inline', links: [] })
    const res = await post(h.app, 'same-key', 'n')
    t.equal(res.statusCode, 201, `${JSON.stringify(scope)}: its own execution`)
    t.equal(res.headers['idempotent-replayed'], undefined, `${JSON.stringify(scope)}: not another scope's replay`)
  }
})

t.test('postgres store: hostile keys, scopes and bodies are replayed byte for byte, and nothing escapes', async (t) => {
  const pg = postgresFixture(t)
  if (pg === null) return
  const store = await pg.store('storage')
  const tablesOf = async (): Promise<string[]> =>
    (await pg.sql<Array<{ name: string }>>`SELECT tablename AS name FROM pg_tables WHERE schemaname = ${pg.schema} ORDER BY 1`).map((row) => row.name)
  const migrated = await tablesOf()
  const h = await storageApp(t, store)
  h.setScope('sentinel')
  h.specs.set('sentinel\u0001sentinel', { status: 201, body: { type: 'text/plain', bytes: Buffer.from('untouched') }, location: '/s', disposition: 'inline', links: [] })
  t.equal((await post(h.app, 'sentinel', 'n')).statusCode, 201)
  const trap = `'; CREATE TABLE ${pg.schema}.pwned (x int); --`
  h.specs.set(`sentinel\u0001${trap}`, { status: 201, body: { type: 'text/plain', bytes: Buffer.from('trap') }, location: '/t', disposition: 'inline', links: [] })
  t.equal((await post(h.app, trap, 'n')).statusCode, 201)

  const used = await byteExactProperty(t, h, 80)

  t.ok(migrated.includes('storage'), 'the records table was migrated')
  t.same(await tablesOf(), migrated, 'the tables are the ones the migration made: none dropped, none created (no "pwned")')
  const [count] = await pg.sql<Array<{ n: number }>>`SELECT count(*)::int AS n FROM ${pg.sql(pg.schema)}.storage`
  t.equal(count?.n, used.length + 2, 'one row per key, no more, no fewer')
  const sentinel = await store.get({ scope: 'sentinel', key: 'sentinel' })
  t.equal(sentinel?.state === 'completed' ? sentinel.response.body?.toString() : null, 'untouched', 'the sentinel record is untouched')
  const stored = await pg.sql<Array<{ scope: string, key: string }>>`SELECT scope, key FROM ${pg.sql(pg.schema)}.storage`
  const roundTrip = new Set(stored.map((row) => `${row.scope}\u0001${row.key}`))
  t.ok(used.every((id) => roundTrip.has(id)), 'every scope and key is stored as the very string it was')
})

t.test('postgres + redis pre-filter: replays served by Redis are byte for byte, and Redis keys never carry client text', async (t) => {
  const pg = postgresFixture(t)
  const redis = redisFixture(t)
  if (pg === null || redis === null) return
  const store = await pg.store('prefiltered')
  const prefilter = redisPrefilter({ client: redis.client, prefix: redis.prefix, timeout: 500 })
  const h = await storageApp(t, store, prefilter)
  const marker = `${redis.prefix}-pwned`
  h.setScope('sentinel')
  const trap = `]]; redis.call('SET', '${marker}', '1') --[[`
  h.specs.set(`sentinel\u0001${trap}`, { status: 201, body: { type: 'text/plain', bytes: Buffer.from(']]\u0000') }, location: '/t', disposition: 'inline', links: [] })
  t.equal((await post(h.app, trap, 'n')).statusCode, 201)
  await copiedToRedis(redis, 'sentinel', trap)

  const used = await byteExactProperty(t, h, 60, { fixture: redis, prefilter })

  t.equal(await redis.client.get(marker), null, 'no Lua or command injection happened')
  const keys = await redis.keys()
  t.equal(keys.length, used.length + 1, 'one hash per record')
  const pattern = new RegExp(`^${redis.prefix}:\\{[A-Za-z0-9_-]{43}\\}$`)
  t.same(keys.filter((key) => !pattern.test(key)), [], 'every Redis key is <prefix>:{base64url SHA-256}: no client text')
  h.setScope('sentinel')
  const again = await post(h.app, trap, 'n')
  t.equal(again.headers['idempotent-replayed'], 'true')
  t.ok(again.rawPayload.equals(Buffer.from(']]\u0000')), 'the trap key still replays its own bytes')
})

t.test('memory + redis pre-filter: scopes with control characters, U+FFFD and astral characters stay apart in Redis too', async (t) => {
  const redis = redisFixture(t)
  if (redis === null) return
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const prefilter = redisPrefilter({ client: redis.client, prefix: redis.prefix, timeout: 500 })
  const h = await storageApp(t, store, prefilter)
  const scopes = ['a\u0001b', 'a', '\u{1F600}', '\ufffd', 'a\u007fb']
  for (const scope of scopes) {
    h.setScope(scope)
    h.specs.set(`${scope}\u0001shared`, { status: 201, body: { type: 'application/octet-stream', bytes: Buffer.from(scope, 'utf16le') }, location: '/x', disposition: 'inline', links: [] })
    const res = await post(h.app, 'shared', 'n')
    t.equal(res.headers['idempotent-replayed'], undefined, `${JSON.stringify(scope)}: its own execution`)
    await copiedToRedis(redis, scope, 'shared')
  }
  for (const scope of scopes) {
    h.setScope(scope)
    const hits = prefilter.stats.hits
    const res = await post(h.app, 'shared', 'n')
    t.equal(prefilter.stats.hits, hits + 1, `${JSON.stringify(scope)}: replayed from Redis`)
    t.ok(res.rawPayload.equals(Buffer.from(scope, 'utf16le')), `${JSON.stringify(scope)}: its own bytes`)
  }
  t.equal((await redis.keys()).length, scopes.length, 'one Redis hash per scope')
})
