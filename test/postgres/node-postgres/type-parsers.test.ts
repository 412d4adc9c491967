import Fastify, { type FastifyInstance } from 'fastify'
import pg from 'pg'
import t, { type Test } from 'tap'
import idempotency from '../../../lib/index.js'
import type { PostgresStore } from '../../../drivers/postgres/index.js'
import { keyed, nodePostgresWorld, poolClientOf } from '../../helpers/node-postgres-world.js'

/**
 * node-postgres's type parsers are global (`pg.types.setTypeParser`), and applications change them
 * (timestamps as strings, int8 as BigInt, ...). The store reads its rows with parsers of its own
 * (drivers/postgres/node-postgres-types.ts), so with every parser of the types it reads (and a few
 * more) overridden, replays are byte-identical, a different request is still 422, and inspect()
 * still gives a Date, numbers, booleans, Buffers and parsed steps. The overrides are undone in
 * teardown.
 */

// bool, bytea, int8, int2, int4, text, json, float4, float8, varchar, timestamp, timestamptz, numeric, uuid, jsonb.
const OIDS = [16, 17, 20, 21, 23, 25, 114, 700, 701, 1043, 1114, 1184, 1700, 2950, 3802]
/** What every overridden parser returns: truthy, not a string, not a Buffer, not a Date. */
const overridden = (text: string): unknown => ({ overridden: text })

/** Every byte value: a body that only survives if bytea is read as bytes. */
const BINARY = Buffer.from(Array.from({ length: 256 }, (_, i) => i))

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/node-postgres/type-parsers.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const db = nodePostgresWorld(t, url)
  const originals = new Map(OIDS.map((oid) => [oid, pg.types.getTypeParser(oid, 'text') as (text: string) => unknown]))
  t.before(() => { for (const oid of OIDS) pg.types.setTypeParser(oid, overridden) })
  t.teardown(() => { for (const [oid, parser] of originals) pg.types.setTypeParser(oid, parser) })

  t.test('the overrides are in effect for the application\'s own queries on the same pool', async (t) => {
    const { rows } = await db.pool.query("SELECT true AS b, now() AS at, '\\x00ff'::bytea AS bytes, '{\"a\":1}'::jsonb AS doc, 1.5::float8 AS f, 7 AS i")
    t.same(rows[0], {
      b: { overridden: 't' }, at: rows[0].at, bytes: { overridden: '\\x00ff' }, doc: { overridden: '{"a": 1}' }, f: { overridden: '1.5' }, i: { overridden: '7' }
    })
    t.notOk(rows[0].at instanceof Date, 'timestamptz is not a Date for the application')
  })

  /** POST /binary answers every byte value, after a recorded step (lease mode) or a write (atomic mode). */
  async function world (t: Test, table: string, transaction: boolean): Promise<{ app: FastifyInstance, store: PostgresStore, runs: () => number }> {
    const store = await db.store(table)
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'test', transaction })
    let runs = 0
    app.post('/binary', async (request, reply) => {
      runs++
      const context = request.idempotency
      if (context === null || context === undefined) throw new Error('unprotected')
      if (transaction) {
        await poolClientOf(request).query(`INSERT INTO ${db.payTable} (key, amount) VALUES ($1, 1)`, [context.key])
      } else {
        await context.step('charge', () => ({ id: 'ch_1', amount: 5, at: '2026-01-01T00:00:00.000Z' }))
      }
      return reply.code(201).type('application/octet-stream').header('location', '/charges/ch_1').send(BINARY)
    })
    return { app, store, runs: () => runs }
  }

  const post = (app: FastifyInstance, key: string, payload: object) => app.inject({ method: 'POST', url: '/binary', headers: keyed(key), payload })

  for (const transaction of [false, true]) {
    const mode = transaction ? 'atomic mode' : 'lease mode'
    t.test(`${mode}: replay, 422 and inspect() read the same with every global parser overridden`, async (t) => {
      const w = await world(t, transaction ? 'atomic' : 'lease', transaction)
      const key = `parsers-${transaction ? 'atomic' : 'lease'}`
      const first = await post(w.app, key, { amount: 1 })
      t.equal(first.statusCode, 201)
      t.ok(first.rawPayload.equals(BINARY))

      const replay = await post(w.app, key, { amount: 1 })
      t.equal(replay.statusCode, 201, 'the recorded status (int4)')
      t.equal(replay.headers['idempotent-replayed'], 'true', 'the claim read its row (booleans, text)')
      t.ok(replay.rawPayload.equals(BINARY), 'byte-identical body (bytea)')
      t.equal(replay.headers['content-type'], 'application/octet-stream', 'the recorded headers (jsonb)')
      t.equal(replay.headers.location, '/charges/ch_1')
      t.equal(w.runs(), 1)

      const different = await post(w.app, key, { amount: 2 })
      t.equal(different.statusCode, 422, 'the recorded fingerprint (bytea digest, text algorithm) still tells a different request')
      t.equal(w.runs(), 1)

      const record = await w.store.inspect({ scope: 'test', key })
      if (record === null) return t.fail('no record')
      t.ok(record.createdAt instanceof Date, 'createdAt is a Date (timestamptz)')
      t.ok(Math.abs(record.createdAt.getTime() - Date.now()) < 60_000, `createdAt is now (${record.createdAt.toISOString()})`)
      t.equal(record.state, 'completed')
      t.equal(record.indeterminate, false, 'a boolean false, not a truthy object')
      t.ok(Buffer.isBuffer(record.fingerprint.digest) && record.fingerprint.digest.length === 32, 'the digest is 32 bytes')
      t.equal(typeof record.fingerprint.algorithm, 'string')
      t.equal(record.leaseRemainingMs, 0, 'float8 read as a number')
      t.ok(typeof record.expiresInMs === 'number' && record.expiresInMs > 0, `expiresInMs is a number (${String(record.expiresInMs)})`)
      t.equal(record.response?.statusCode, 201)
      t.ok(record.response?.body?.equals(BINARY), 'the recorded body')
      t.same(record.steps, transaction ? {} : { charge: { id: 'ch_1', amount: 5, at: '2026-01-01T00:00:00.000Z' } }, 'steps parsed from jsonb')
    })
  }
}
