import { randomBytes } from 'node:crypto'
import { createRequire } from 'node:module'
import Fastify, { type FastifyInstance } from 'fastify'
import pg from 'pg'
import QueryStream from 'pg-query-stream'
import postgres, { type TransactionSql } from 'postgres'
import t, { type Test } from 'tap'
import idempotency from '../../lib/index.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { citusViolations } from '../helpers/citus-statements.js'
import { CLIENT, endPools, exec, poolLike, recordingConnection, storeConnection } from '../helpers/postgres-clients.js'
import { settledCounts } from '../helpers/pool-accounting.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Atomic mode, a handler that ends the request's transaction itself through request.idempotency.sql
 * (a COMMIT, ROLLBACK or PREPARE TRANSACTION however it is written, or sent), end to end through the
 * plugin on a real PostgreSQL (DATABASE_URL), on the client under test (test/helpers/postgres-clients.ts).
 *
 * What must hold: nothing the handle sends after such a statement runs; the response is not recorded;
 * the key is HELD for the reconciler (in progress, `indeterminate`, never expiring), so a retry gets
 * 409 and never runs the handler a second time, also once the lease has passed; the client gets a
 * 500 problem `transaction-ended` (or, when the handler failed anyway, its own error). A statement
 * that the server refuses (several statements in one text) ends nothing: the request rolls back
 * as usual and its key is released.
 */

// pg-cursor has no type declarations.
const Cursor = createRequire(import.meta.url)('pg-cursor') as new (text: string) => pg.Submittable & {
  read (rows: number): Promise<unknown[]>
  close (): Promise<void>
}

const keyed = (key: string): Record<string, string> => ({ 'idempotency-key': `"${key}"`, 'content-type': 'application/json' })
const LEASE_MS = 100
const ENDED = 'tag:fastify-idempotency,2026:transaction-ended'
const NOT_COMMITTED = 'tag:fastify-idempotency,2026:not-committed'

/** What the statement does to the request's transaction. */
type Effect = 'commits' | 'rolls back' | 'refused'

interface Case {
  readonly name: string
  readonly effect: Effect
  /** The statement itself fails (and its failure ends the transaction). */
  readonly fails?: boolean
  send (tx: unknown): Promise<unknown>
}

/** The statement as a text query: `client.query(text)` on node-postgres, `unsafe(text)` on postgres.js. */
const text = (name: string, effect: Effect, fails = false): Case => ({ name: JSON.stringify(name), effect, fails, send: async (tx) => await exec(tx, name) })

function cases (): Case[] {
  const common = [
    text(';COMMIT', 'commits'),
    text('-- c\rCOMMIT', 'commits'),
    text('/* a /* nested */ comment */ COMMIT', 'commits'),
    text('SELECT 1; COMMIT', 'refused'),
    text('COMMIT AND CHAIN', 'commits'),
    text('ROLLBACK', 'rolls back'),
    text('ROLLBACK AND CHAIN', 'rolls back'),
    // max_prepared_transactions is 0 by default: it fails, and a failed PREPARE TRANSACTION rolls back.
    text("PREPARE TRANSACTION 'x'", 'rolls back', true)
  ]
  if (CLIENT === 'pg') {
    const client = (tx: unknown): pg.PoolClient => tx as pg.PoolClient
    return [...common, {
      name: "new QueryStream('COMMIT')",
      effect: 'commits',
      async send (tx) {
        // eslint-disable-next-line no-empty
        for await (const _ of client(tx).query(new QueryStream('COMMIT'))) {}
      }
    }, {
      name: "new Cursor('COMMIT')",
      effect: 'commits',
      async send (tx) {
        const cursor = client(tx).query(new Cursor('COMMIT'))
        await cursor.read(10)
        await cursor.close()
      }
    }, {
      name: "{ text: 'COMMIT' }",
      effect: 'commits',
      send: async (tx) => await client(tx).query({ text: 'COMMIT' })
    }]
  }
  const sql = (tx: unknown): TransactionSql<any> => tx as TransactionSql<any>
  return [...common, {
    name: 'tx`COMMIT`',
    effect: 'commits',
    send: async (tx) => await sql(tx)`COMMIT`
  }, {
    name: "tx.unsafe('commit')",
    effect: 'commits',
    send: async (tx) => await sql(tx).unsafe('commit')
  }, {
    name: 'tx`COMMIT`.simple()',
    effect: 'commits',
    send: async (tx) => await sql(tx)`COMMIT`.simple()
  }, {
    name: "tx.unsafe('select 1; commit')",
    effect: 'refused',
    send: async (tx) => await sql(tx).unsafe('select 1; commit')
  }, {
    name: 'tx`COMMIT`.cursor()',
    effect: 'commits',
    async send (tx) {
      // eslint-disable-next-line no-empty
      for await (const _ of sql(tx)`COMMIT`.cursor()) {}
    }
  }]
}

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const appName = `idem-ended-${id}`
  const sql = postgres(url, { max: 6, onnotice: () => {}, connection: { application_name: appName } })
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_ended',
    client: { max: 2 },
    migrate: ['records'],
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.payments (key text NOT NULL, note text NOT NULL)`
  })
  const payTable = `"${schema}".payments`
  t.teardown(async () => {
    await sql.end({ timeout: 2 })
    await endPools()
  })

  const effects = async (key: string): Promise<string[]> =>
    (await admin`SELECT note FROM ${admin(schema)}.payments WHERE key = ${key} ORDER BY note`).map((row) => String(row.note))
  interface Row { state: string, indeterminate: boolean, forever: boolean }
  const record = async (key: string): Promise<Row | null> => {
    const [row] = await admin`SELECT state, indeterminate, expires_at = 'infinity' AS forever FROM ${admin(schema)}.records WHERE key = ${key}`
    return row === undefined ? null : { state: String(row.state), indeterminate: row.indeterminate === true, forever: row.forever === true }
  }
  const idleInTransaction = async (): Promise<number> => {
    for (let i = 0; i < 100; i++) {
      const [row] = await admin`SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = ${appName} AND state LIKE 'idle in transaction%'`
      if (Number(row?.n) === 0) return 0
      await sleep(20)
    }
    return -1
  }

  interface World {
    app: FastifyInstance
    store: PostgresStore
    runs: () => number
    /** What the handler's statement, and its write after it, failed with (undefined: they ran). */
    seen: { statement?: unknown, after?: unknown }
  }

  /**
   * POST /pay writes an effect row, sends `send` (its failure is caught), writes a second row, and
   * then throws or answers 201 (`then` in the body).
   */
  async function world (t: Test, send: (tx: unknown) => Promise<unknown>): Promise<World> {
    const store = postgresStore({ ...storeConnection(sql), schema, table: 'records', purgeInterval: 0 })
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'test', transaction: true, lease: LEASE_MS })
    let runs = 0
    const seen: World['seen'] = {}
    app.post<{ Body: { then: 'throw' | 'return' } }>('/pay', async (request, reply) => {
      runs++
      const tx = request.idempotency?.sql
      const key = request.idempotency?.key ?? ''
      await exec(tx, `INSERT INTO ${payTable} (key, note) VALUES ($1, 'effect')`, [key])
      seen.statement = await send(tx).then(() => undefined, (err: unknown) => err)
      seen.after = await exec(tx, `INSERT INTO ${payTable} (key, note) VALUES ($1, 'after')`, [key]).then(() => undefined, (err: unknown) => err)
      if (request.body.then === 'throw') throw new Error('after the statement')
      return reply.code(201).send({ paid: key })
    })
    return { app, store, runs: () => runs, seen }
  }

  const pay = (app: FastifyInstance, key: string, then: 'throw' | 'return') =>
    app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: { then } })

  /** Every transaction ended and every connection went back, not left inside a transaction. */
  async function clean (t: Test, w: World): Promise<void> {
    for (let i = 0; i < 300 && w.store.openTransactions > 0; i++) await sleep(10)
    t.equal(w.store.openTransactions, 0, 'no transaction left open')
    t.equal(await idleInTransaction(), 0, 'no connection left idle in a transaction')
    if (CLIENT === 'pg') {
      const counts = await settledCounts(poolLike(sql))
      t.equal(counts.idle, counts.total, `every client is back in the pool (${JSON.stringify(counts)})`)
    }
  }

  for (const c of cases()) {
    for (const then of ['throw', 'return'] as const) {
      t.test(`${c.name} (${c.effect}), then the handler ${then === 'throw' ? 'throws' : 'answers 201'}`, async (t) => {
        const w = await world(t, c.send)
        const key = `k-${randomBytes(6).toString('hex')}`
        const answer = await pay(w.app, key, then)
        t.equal(answer.statusCode, 500, answer.body)
        if (c.effect === 'refused') {
          t.ok(w.seen.statement instanceof Error, `the server refused the statement: ${String(w.seen.statement)}`)
          t.equal((w.seen.statement as { code?: unknown }).code, '42601', 'cannot insert multiple commands into a prepared statement')
          if (then === 'throw') t.equal(answer.json().message, 'after the statement', "the handler's own error")
          else t.equal(answer.json().type, NOT_COMMITTED, 'the failed transaction could not commit: 500 not-committed')
          t.same(await effects(key), [], 'nothing committed')
          t.equal(await record(key), null, 'the key was released')
          await sleep(LEASE_MS + 50)
          t.equal((await pay(w.app, key, then)).statusCode, 500, 'a retry runs the handler again (nothing of the first run happened)')
          t.equal(w.runs(), 2)
          return await clean(t, w)
        }
        if (c.fails === true) t.ok(w.seen.statement instanceof Error, `the statement failed: ${String(w.seen.statement)}`)
        else t.equal(w.seen.statement, undefined, 'the statement ran')
        t.match(String(w.seen.after), /ended the request's transaction itself/, 'the write after it was refused, never sent')
        if (then === 'throw') {
          t.equal(answer.json().message, 'after the statement', "the handler's own error")
        } else {
          t.equal(answer.json().type, ENDED, 'a 500 problem transaction-ended, never the handler\'s 201')
          t.notMatch(answer.body, /paid/)
        }
        t.same(await effects(key), c.effect === 'commits' ? ['effect'] : [], c.effect === 'commits' ? 'the effect committed with the statement' : 'the effect rolled back with the statement')
        t.same(await record(key), { state: 'in_progress', indeterminate: true, forever: true }, 'the key is held for the reconciler')
        t.equal((await pay(w.app, key, then)).statusCode, 409, 'a retry (the same request) is refused')
        await sleep(LEASE_MS + 50)
        t.equal((await pay(w.app, key, then)).statusCode, 409, 'also once the lease has passed')
        t.equal(w.runs(), 1, 'the handler ran once')
        t.same(await effects(key), c.effect === 'commits' ? ['effect'] : [], 'one effect at most')
        await clean(t, w)
      })
    }
  }

  t.test('the claim is written held, and recorded as an ordinary completed record', async (t) => {
    let inside: unknown
    const w = await world(t, async (tx) => {
      inside = (await exec(tx, `SELECT indeterminate, expires_at = 'infinity' AS forever FROM "${schema}".records WHERE scope = 'test'`))[0]
    })
    const key = `k-${randomBytes(6).toString('hex')}`
    t.equal((await pay(w.app, key, 'return')).statusCode, 201)
    t.same(inside, { indeterminate: true, forever: true }, 'inside the transaction, the claim is held: a COMMIT there would leave it held')
    t.same(await record(key), { state: 'completed', indeterminate: false, forever: false }, 'committed with its response, no longer held')
    t.same(await effects(key), ['after', 'effect'])
    const replay = await pay(w.app, key, 'return')
    t.equal(replay.headers['idempotent-replayed'], 'true')
    t.equal(w.runs(), 1)
    await clean(t, w)
  })

  t.test('a claim committed early stays held even when nothing runs after the COMMIT (the connection dies there)', async (t) => {
    const w = await world(t, async (tx) => {
      const [row] = await exec(tx, 'SELECT pg_backend_pid() AS pid')
      await exec(tx, 'COMMIT')
      await admin`SELECT pg_terminate_backend(${Number(row?.pid)})`
      await sleep(50)
    })
    const key = `k-${randomBytes(6).toString('hex')}`
    const answer = await pay(w.app, key, 'return')
    t.equal(answer.statusCode, 500)
    t.equal(answer.json().type, ENDED)
    t.same(await effects(key), ['effect'], 'the effect committed early')
    t.same(await record(key), { state: 'in_progress', indeterminate: true, forever: true }, 'held by the claim itself: no hold could be written')
    await sleep(LEASE_MS + 50)
    t.equal((await pay(w.app, key, 'return')).statusCode, 409, 'a retry past the lease is refused')
    t.equal(w.runs(), 1)
  })

  // postgres.js rolls a transaction back when any query sent through its handle failed (it throws
  // the first failure when the callback returns): there, sql.savepoint() recovers from one (below).
  t.test(`ROLLBACK TO SAVEPOINT${CLIENT === 'pg' ? ', also after a failed statement,' : ''} ends nothing: the request commits`, async (t) => {
    const w = await world(t, async (tx) => {
      await exec(tx, 'SAVEPOINT before_failure')
      if (CLIENT === 'pg') await exec(tx, 'SELECT 1 / 0').catch(() => {})
      await exec(tx, 'ROLLBACK TO SAVEPOINT before_failure')
    })
    const key = `k-${randomBytes(6).toString('hex')}`
    const answer = await pay(w.app, key, 'return')
    t.equal(answer.statusCode, 201, answer.body)
    t.equal(w.seen.after, undefined)
    t.same(await effects(key), ['after', 'effect'])
    t.same(await record(key), { state: 'completed', indeterminate: false, forever: false })
    await clean(t, w)
  })

  if (CLIENT === 'postgres') {
    t.test('postgres.js: a query that fails inside sql.savepoint() is recovered, and the request commits', async (t) => {
      const key = `k-${randomBytes(6).toString('hex')}`
      const w = await world(t, async (tx) => {
        const failed = await (tx as TransactionSql<any>).savepoint(async (sp) => await sp`SELECT 1 / 0`).then(() => null, (err: unknown) => err)
        if (!(failed instanceof Error)) throw new Error('the savepoint should have failed')
        await (tx as TransactionSql<any>).savepoint(async (sp) => await sp`INSERT INTO ${sp(schema)}.payments (key, note) VALUES (${key}, 'in savepoint')`)
      })
      const answer = await pay(w.app, key, 'return')
      t.equal(answer.statusCode, 201, answer.body)
      t.same(await effects(key), ['after', 'effect', 'in savepoint'])
      t.same(await record(key), { state: 'completed', indeterminate: false, forever: false })
      await clean(t, w)
    })

    t.test('postgres.js: prepare() on the handle is refused (it would turn the COMMIT into a PREPARE TRANSACTION)', async (t) => {
      const w = await world(t, async (tx) => { (tx as TransactionSql<any>).prepare('x') })
      const key = `k-${randomBytes(6).toString('hex')}`
      t.equal((await pay(w.app, key, 'return')).statusCode, 201)
      t.match(String(w.seen.statement), /PREPARE TRANSACTION, which commits nothing/)
      t.same(await record(key), { state: 'completed', indeterminate: false, forever: false })
      await clean(t, w)
    })
  }

  t.test('what the store sends when the handler ended the transaction keeps to the forms Citus distributes', async (t) => {
    const sent = new Set<string>()
    const recording = recordingConnection(url, sql, sent)
    t.teardown(recording.end)
    const store = postgresStore({ ...recording.connection, schema, table: 'records', purgeInterval: 0 })
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'test', transaction: true })
    const handlers = new Set<string>()
    app.post<{ Body: { statement: string } }>('/end', async (request, reply) => {
      const insert = `INSERT INTO ${payTable} (key, note) VALUES ('${request.idempotency?.key ?? ''}', 'effect')`
      handlers.add(insert)
      handlers.add(request.body.statement)
      await exec(request.idempotency?.sql, insert)
      await exec(request.idempotency?.sql, request.body.statement)
      return reply.code(201).send({})
    })
    // The hold of a committed claim, of a rolled-back one (inserted), on the transaction's
    // connection after AND CHAIN, and (postgres.js) from another connection after plain COMMIT.
    for (const statement of ['COMMIT', 'ROLLBACK', 'COMMIT AND CHAIN', 'ROLLBACK AND CHAIN']) {
      const key = `k-${randomBytes(6).toString('hex')}`
      const answer = await app.inject({ method: 'POST', url: '/end', headers: keyed(key), payload: { statement } })
      t.equal(answer.json().type, ENDED, statement)
      t.same(await record(key), { state: 'in_progress', indeterminate: true, forever: true }, `${statement}: held`)
    }
    const driver = [...sent].filter((text) => !handlers.has(text))
    t.ok(driver.some((text) => /insert into .*records.*on conflict \(scope, key\) do nothing\s*$/is.test(text)), 'the held insert was sent')
    for (const text of driver) t.same(citusViolations(text), [], text)
  })

  t.test('a BEGIN through the handle starts nothing; every later query is refused, and the request rolls back', async (t) => {
    const w = await world(t, async (tx) => { await exec(tx, 'BEGIN') })
    const key = `k-${randomBytes(6).toString('hex')}`
    const answer = await pay(w.app, key, 'throw')
    t.equal(answer.statusCode, 500)
    t.equal(w.seen.statement, undefined, 'BEGIN itself ran (a warning inside a transaction)')
    t.match(String(w.seen.after), /already inside the request's transaction/)
    t.same(await effects(key), [], 'nothing committed')
    t.equal(await record(key), null, 'the key was released')
    await clean(t, w)
  })
}

// Last: the suite uses the constants above.
const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/atomic-ended.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}
