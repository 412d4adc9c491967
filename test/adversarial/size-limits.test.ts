import assert from 'node:assert/strict'
import { createHash } from 'node:crypto'
import { Readable } from 'node:stream'
import fc from 'fast-check'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type IdempotencyOptions, type MemoryStoreOptions } from '../../lib/index.js'
import type { IdempotencyStore } from '../../lib/core/store.js'
import { manualClock } from '../helpers/app.js'
import { postgresFixture } from './services.js'
import { assertProblem, counted, errorLog, fcParams, listen, rawExchange, type CountedStore } from './support.js'

/*
 * Sizes an attacker (or an unlucky client) controls: request bodies past Fastify's bodyLimit,
 * responses past maxResponseBytes, and floods of distinct keys against a small memory store.
 * Each ends in a clear answer, records nothing it should not, and never runs a handler twice.
 */

const BODY_LIMIT = 1024

interface SizeApp {
  readonly app: FastifyInstance
  readonly store: CountedStore
  readonly runs: () => number
  readonly errors: string[]
}

type Shape = 'buffer' | 'string' | 'stream'

async function sizeApp (t: Test, options: { plugin?: IdempotencyOptions, store?: IdempotencyStore, memory?: MemoryStoreOptions } = {}): Promise<SizeApp> {
  const log = errorLog()
  const app = Fastify({ logger: log.logger, bodyLimit: BODY_LIMIT })
  const inner = options.store ?? memoryStore({ purgeInterval: 0, ...options.memory })
  if (options.store === undefined) t.teardown(() => inner.close())
  const store = counted(inner)
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: () => 'test', ...options.plugin })
  let runs = 0
  // POST /echo answers 201 with a response of `size` bytes in the shape asked for.
  app.post('/echo', async (request, reply) => {
    runs++
    const query = request.query as { size?: string, shape?: Shape }
    const bytes = Buffer.alloc(Number(query.size ?? 2), 'r')
    reply.code(201).type('application/octet-stream')
    if (query.shape === 'string') return reply.type('text/plain').send(bytes.toString())
    if (query.shape === 'stream') return reply.send(Readable.from([bytes.subarray(0, bytes.length >> 1), bytes.subarray(bytes.length >> 1)]))
    return reply.send(bytes)
  })
  return { app, store, runs: () => runs, errors: log.lines }
}

function echo (app: FastifyInstance, key: string, payload: string, query = ''): Promise<LightMyRequestResponse> {
  return app.inject({ method: 'POST', url: `/echo${query}`, headers: { 'idempotency-key': `"${key}"`, 'content-type': 'application/json' }, payload })
}

const jsonOfSize = (bytes: number): string => JSON.stringify({ pad: 'p'.repeat(Math.max(0, bytes - 10)) })

// ---------------------------------------------------------------------------------------------
// Request bodies past bodyLimit

for (const fingerprint of ['canonical', 'raw'] as const) {
  t.test(`${fingerprint}: a body over bodyLimit is 413 before the claim; nothing is recorded and the key stays free`, async (t) => {
    const h = await sizeApp(t, { plugin: { fingerprint } })
    for (const size of [BODY_LIMIT + 1, 16 * 1024, 1024 * 1024]) {
      const res = await echo(h.app, 'big-body', jsonOfSize(size))
      t.equal(res.statusCode, 413, `${size} bytes: 413`)
      t.match(res.json(), { code: 'FST_ERR_CTP_BODY_TOO_LARGE' }, 'Fastify\'s own answer')
    }
    t.equal(h.runs(), 0, 'the handler never ran')
    t.equal(h.store.claims(), 0, 'the store was never asked')
    t.equal(await h.store.get({ scope: 'test', key: 'big-body' }), null, 'no record')
    const corrected = await echo(h.app, 'big-body', jsonOfSize(BODY_LIMIT))
    t.equal(corrected.statusCode, 201, 'the corrected request (at the limit) executes')
    t.equal((await echo(h.app, 'big-body', jsonOfSize(BODY_LIMIT))).headers['idempotent-replayed'], 'true')
    t.equal(h.runs(), 1)
    t.same(h.errors, [], 'nothing was logged at error level')
  })

  t.test(`${fingerprint}: a chunked body that grows past bodyLimit on a real socket is 413; nothing is recorded`, async (t) => {
    const h = await sizeApp(t, { plugin: { fingerprint } })
    const port = await listen(h.app)
    const chunk = `{"pad":"${'p'.repeat(600)}`
    const chunks = [chunk, 'p'.repeat(600), 'p'.repeat(600), '"}']
    const body = chunks.map((c) => `${c.length.toString(16)}\r\n${c}\r\n`).join('') + '0\r\n\r\n'
    const res = await rawExchange(port, Buffer.from(
      'POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n' +
      `Idempotency-Key: "chunked"\r\nConnection: close\r\n\r\n${body}`, 'latin1'))
    t.equal(res.statusCode, 413, `413 (${res.text.slice(0, 60)})`)
    t.equal(h.runs(), 0)
    t.equal(h.store.claims(), 0)
    t.equal(await h.store.get({ scope: 'test', key: 'chunked' }), null, 'no record')
  })
}

// ---------------------------------------------------------------------------------------------
// Responses past maxResponseBytes

t.test('any response size and shape: replayed when <= maxResponseBytes, else 410 with originalStatus; one execution', async (t) => {
  const limit = 1024
  const h = await sizeApp(t, { plugin: { maxResponseBytes: limit } })
  let n = 0
  const seen = { replayed: 0, gone: 0 }
  await fc.assert(fc.asyncProperty(fc.oneof(fc.integer({ min: 0, max: 3 * limit }), fc.constantFrom(limit - 1, limit, limit + 1)),
    fc.constantFrom<Shape>('buffer', 'string', 'stream'), async (size, shape) => {
      const key = `response-${n++}`
      const query = `?size=${size}&shape=${shape}`
      const runs = h.runs()
      const first = await echo(h.app, key, '{}', query)
      assert.equal(first.statusCode, 201)
      assert.equal(first.rawPayload.length, size, 'the first client gets the whole body, whatever its size')
      for (let retry = 0; retry < 2; retry++) {
        const res = await echo(h.app, key, '{}', query)
        if (size <= limit) {
          assert.equal(res.headers['idempotent-replayed'], 'true', `${size} bytes (${shape}): replayed`)
          assert.ok(res.rawPayload.equals(first.rawPayload), 'the same bytes')
        } else {
          const problem = assertProblem(res, 'response-not-retained', 410, `${size} bytes (${shape})`)
          assert.equal(problem.originalStatus, 201, 'originalStatus')
        }
      }
      assert.equal(h.runs(), runs + 1, 'one execution, never a second')
      seen[size <= limit ? 'replayed' : 'gone']++
    }), fcParams(0x410, 120))
  t.ok(seen.replayed > 10 && seen.gone > 10, `both sides of the limit (${JSON.stringify(seen)})`)
  t.same(h.errors, [], 'nothing was logged at error level')
})

t.test('postgres: a response over maxResponseBytes is recorded without its body; retries get 410, the handler ran once', async (t) => {
  const pg = postgresFixture(t)
  if (pg === null) return
  const h = await sizeApp(t, { store: await pg.store('sizes'), plugin: { maxResponseBytes: 1024 } })
  for (const shape of ['buffer', 'stream'] as const) {
    const key = `pg-${shape}`
    t.equal((await echo(h.app, key, '{}', `?size=4096&shape=${shape}`)).rawPayload.length, 4096)
    for (let retry = 0; retry < 2; retry++) {
      const res = await echo(h.app, key, '{}', `?size=4096&shape=${shape}`)
      t.doesNotThrow(() => assertProblem(res, 'response-not-retained', 410), `${shape}, retry ${retry + 1}: 410`)
    }
    const record = await h.store.get({ scope: 'test', key })
    t.match(record, { state: 'completed', response: { statusCode: 201, body: null } }, `${shape}: completed, body not retained`)
  }
  t.equal(h.runs(), 2, 'one execution per key')
})

/** `length` characters of base64 that PostgreSQL cannot compress (a SHA-256 chain), the same on every run. */
function incompressibleKey (length: number): string {
  let out = ''
  for (let block = createHash('sha256').update('seed').digest(); out.length < length; block = createHash('sha256').update(block).digest()) {
    out += block.toString('base64url')
  }
  return out.slice(0, length)
}

t.test('postgres: keys past a B-tree entry (README: about 2.6 kB with the scope) get 503; shorter long keys work', async (t) => {
  const pg = postgresFixture(t)
  if (pg === null) return
  const h = await sizeApp(t, { store: await pg.store('long_keys'), plugin: { maxKeyLength: 8192 } })
  const fits = incompressibleKey(2600)
  t.equal((await echo(h.app, fits, '{}')).statusCode, 201, '2600 incompressible characters: executed')
  t.equal((await echo(h.app, fits, '{}')).headers['idempotent-replayed'], 'true', 'and replayed')
  for (const length of [2800, 8192]) {
    const res = await echo(h.app, incompressibleKey(length), '{}')
    t.doesNotThrow(() => assertProblem(res, 'store-unavailable', 503), `${length} incompressible characters: 503 store-unavailable`)
  }
  t.equal(h.runs(), 1, 'the handler never ran for a key the store could not hold')
  t.equal(h.errors.length, 2, 'each was logged as a store error')
})

// ---------------------------------------------------------------------------------------------
// Floods of distinct keys against a small memory store

t.test('a flood of distinct keys against maxEntries: 503 store-unavailable past the limit, live records kept, room again after expiry', async (t) => {
  const clock = manualClock()
  const maxEntries = 100
  const ttl = 60_000
  // One scope ('test') against the whole store's bound: its share is the whole store (the shares: test/memory/fairness.test.ts).
  const h = await sizeApp(t, { memory: { maxEntries, maxEntriesPerScope: maxEntries, now: clock.now }, plugin: { ttl } })
  const answers = new Map<number, number>()
  for (let i = 0; i < 1000; i++) {
    const res = await echo(h.app, `flood-${i}`, '{}')
    answers.set(res.statusCode, (answers.get(res.statusCode) ?? 0) + 1)
    if (res.statusCode === 503) {
      assertProblem(res, 'store-unavailable', 503)
      assert.equal(res.headers['retry-after'], '1')
    }
  }
  t.same(Object.fromEntries(answers), { 201: maxEntries, 503: 1000 - maxEntries }, 'exactly maxEntries executions, the rest refused')
  t.equal(h.runs(), maxEntries)
  t.equal(h.errors.length, 1000 - maxEntries, 'each refusal is logged as a store error, so it is visible')

  const early = await echo(h.app, 'flood-0', '{}')
  t.equal(early.headers['idempotent-replayed'], 'true', 'a full store still replays the records it holds (none is dropped)')
  const refused = await echo(h.app, 'flood-999', '{}')
  t.equal(refused.statusCode, 503, 'a refused key is still refused while the store is full')

  clock.advance(ttl + 1)
  const later = await echo(h.app, 'flood-999', '{}')
  t.equal(later.statusCode, 201, 'once records expired, the refused key executes (its 503 was not recorded)')
  t.equal(h.runs(), maxEntries + 1)
})

t.test('a flood of large responses against maxBytes: the store never holds more than its budget; answers that do not fit are recorded without their bodies (retries get 410), then new keys get 503', async (t) => {
  const maxBytes = 64 * 1024
  const recordBytes = 4096
  // One scope alone may use the whole store (its share limits it only beside other scopes: test/memory/fairness.test.ts).
  const inner = memoryStore({ purgeInterval: 0, maxBytes })
  const h = await sizeApp(t, { store: inner })
  t.teardown(() => inner.close())
  let executed = 0
  let refused = 0
  for (let i = 0; i < 100; i++) {
    const res = await echo(h.app, `bytes-${i}`, '{}', `?size=${recordBytes}`)
    if (res.statusCode === 201) executed++
    else if (res.statusCode === 503) refused++
    assert.ok(inner.usage().bytes <= maxBytes, `the store holds ${inner.usage().bytes} bytes`)
  }
  t.equal(executed + refused, 100, 'every answer was 201 or 503')
  t.ok(refused > 0, `the budget refused keys (${refused})`)
  let replayed = 0
  let notRetained = 0
  for (let i = 0; i < executed; i++) {
    const res = await echo(h.app, `bytes-${i}`, '{}', `?size=${recordBytes}`)
    if (res.headers['idempotent-replayed'] === 'true' && res.rawPayload.length === recordBytes) replayed++
    else if (res.statusCode === 410) { assertProblem(res, 'response-not-retained', 410); notRetained++ }
  }
  t.equal(replayed + notRetained, executed, `each executed key replays (${replayed}) or reports its answer not retained (${notRetained})`)
  t.ok(replayed * recordBytes <= maxBytes, `${replayed} answers of ${recordBytes} bytes kept whole within a ${maxBytes}-byte budget`)
  t.ok(replayed >= (maxBytes / recordBytes) / 2, 'and the budget was not refused needlessly early')
  t.equal(h.runs(), executed, 'no key ran twice')
})
