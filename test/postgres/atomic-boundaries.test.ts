import { writeFileSync, mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import { Readable } from 'node:stream'
import Fastify, { type FastifyInstance, type FastifyRequest, type LightMyRequestResponse } from 'fastify'
import pg from 'pg'
import postgres, { type TransactionSql } from 'postgres'
import t, { type Test } from 'tap'
import idempotency, { type IdempotencyOptions } from '../../lib/index.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { CLIENT, endPools, exec, poolLike, storeConnection } from '../helpers/postgres-clients.js'
import { settledCounts } from '../helpers/pool-accounting.js'
import { poolClientOf } from '../helpers/node-postgres-world.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Atomic mode (transaction: true) against a real PostgreSQL: retention counts from the
 * commit (case 7), no handler query reaches the connection once the request's transaction ended
 * (case 8), a COMMIT whose outcome is unknown is never answered as a rollback (case 9), and a
 * stream of string chunks is recorded like any other (case 10). The store runs on the client under
 * test (test/helpers/postgres-clients.ts); case 8 is about each client's own handle: postgres.js's
 * tagged templates, savepoints and file(), or node-postgres's PoolClient and its query() forms.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/atomic-boundaries.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

/** The request's transaction (atomic mode), or a failure of the test: a postgres.js TransactionSql. */
function transactionOf (request: FastifyRequest): TransactionSql<any> {
  const tx = request.idempotency?.sql
  if (tx === undefined) throw new Error('not in atomic mode')
  return tx
}
const keyed = (key: string): Record<string, string> => ({ 'idempotency-key': `"${key}"`, 'content-type': 'application/json' })

function suite (url: string): void {
  const sql = postgres(url, { max: 10, onnotice: () => {}, fetch_types: false })
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_atomic_edges',
    client: { max: 2, fetch_types: false },
    setup: async ({ sql: admin, name: schema }) => {
      await admin`CREATE TABLE ${admin(schema)}.payments (key text NOT NULL, note text)`
      // A COMMIT that takes 600 ms: a deferred constraint trigger on `slow` rows sleeps at commit time.
      await admin.unsafe(`
        CREATE FUNCTION ${schema}.slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN IF NEW.note = 'slow' THEN PERFORM pg_sleep(0.6); END IF; RETURN NULL; END $$`)
      await admin.unsafe(`
        CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON ${schema}.payments
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ${schema}.slow_commit()`)
    }
  })
  const stores: PostgresStore[] = []
  const payTable = `"${schema}".payments`
  t.teardown(async () => {
    for (const store of stores) await store.close()
    await sql.end({ timeout: 2 })
    await endPools()
  })

  let tables = 0
  async function world (t: Test, options: IdempotencyOptions = {}): Promise<{ app: FastifyInstance, store: PostgresStore, post: (url: string, key: string) => Promise<LightMyRequestResponse> }> {
    const store = postgresStore({ ...storeConnection(sql), schema, table: `records_${++tables}`, purgeInterval: 0 })
    await store.migrate()
    stores.push(store)
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'acct', transaction: true, ...options })
    return { app, store, post: (url, key) => app.inject({ method: 'POST', url, headers: keyed(key), payload: {} }) }
  }
  const payments = async (key: string): Promise<number> =>
    Number((await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.payments WHERE key = ${key}`)[0]?.n)

  t.test('case 7: a handler slower than the ttl commits a record retained for the ttl from its commit', async (t) => {
    const w = await world(t)
    let runs = 0
    w.app.post('/slow', { config: { idempotency: { ttl: 500 } } }, async (request, reply) => {
      runs++
      await exec(transactionOf(request), `INSERT INTO ${payTable} (key) VALUES ('slow-ttl')`)
      await sleep(800)
      return reply.code(201).send({ ok: true })
    })
    t.equal((await w.post('/slow', 'slow-ttl')).statusCode, 201)
    const retry = await w.post('/slow', 'slow-ttl')
    t.equal(retry.headers['idempotent-replayed'], 'true', 'right after the commit the record replays (it used to be born expired)')
    t.equal(runs, 1)
    t.equal(await payments('slow-ttl'), 1, 'one payment')
  })

  // postgres.js: tagged templates (sent when awaited), savepoint handles, unsafe() and file().
  if (CLIENT === 'postgres') {
    t.test('case 8: no query reaches the connection after the transaction ended, whichever handle or timing', async (t) => {
      const w = await world(t)
      const attempts: Array<() => Promise<unknown>> = []
      const dir = mkdtempSync(path.join(tmpdir(), 'idem-file-'))
      t.teardown(() => rmSync(dir, { recursive: true, force: true }))
      const fileWithInsert = path.join(dir, 'insert.sql')
      writeFileSync(fileWithInsert, `INSERT INTO ${schema}.payments (key, note) VALUES ('leak', 'file')`)
      w.app.post('/leak', async (request, reply) => {
        const tx = transactionOf(request)
        // A query built now and awaited only after the transaction ended.
        const built = tx`INSERT INTO ${tx(schema)}.payments (key, note) VALUES ('leak', 'built before the end')`
        attempts.push(async () => await built)
        // A savepoint's handle kept past the savepoint and the transaction.
        let kept!: TransactionSql<any>
        await tx.savepoint(async (savepoint) => {
          kept = savepoint
          await savepoint`SELECT 1`
        })
        attempts.push(async () => await kept`INSERT INTO ${kept(schema)}.payments (key, note) VALUES ('leak', 'savepoint handle')`)
        attempts.push(async () => await tx.unsafe(`INSERT INTO ${schema}.payments (key, note) VALUES ('leak', 'unsafe')`))
        attempts.push(async () => await tx.file(fileWithInsert))
        return reply.code(500).send({ error: 'the handler fails: everything rolls back' })
      })

      t.equal((await w.post('/leak', 'leak')).statusCode, 500)
      await sleep(50) // the rollback has happened, and the connection is back in the pool
      for (const attempt of attempts) {
        await t.rejects(attempt(), /transaction has ended/, 'refused')
      }
      await sleep(50)
      t.equal(await payments('leak'), 0, 'nothing was written outside the transaction')
    })
  }

  // postgres.js's file() (node-postgres has none).
  if (CLIENT === 'postgres') {
    t.test('case 8: a file() query whose read outlasts the transaction is refused when it would be sent', async (t) => {
      const w = await world(t)
      let pending: Promise<unknown> | null = null
      const dir = mkdtempSync(path.join(tmpdir(), 'idem-file-'))
      t.teardown(() => rmSync(dir, { recursive: true, force: true }))
      const file = path.join(dir, 'insert.sql')
      writeFileSync(file, `INSERT INTO ${schema}.payments (key, note) VALUES ('file-late', 'x')`)
      w.app.post('/file', async (request, reply) => {
        const tx = transactionOf(request)
        pending = tx.file(file).catch((err: unknown) => err)
        return reply.code(500).send({ error: 'rolled back' })
      })
      t.equal((await w.post('/file', 'file-late')).statusCode, 500)
      const outcome = await pending
      t.match(String(outcome), /transaction has ended/)
      t.equal(await payments('file-late'), 0)
    })
  }

  // node-postgres's PoolClient: query() in its promise, callback and submittable forms, and release().
  if (CLIENT === 'pg') {
    for (const [status, ended] of [[500, 'rolled back'], [201, 'committed']] as const) {
      t.test(`case 8 (node-postgres): once the transaction ${ended}, the PoolClient refuses every form of query() and release() throws; nothing is written`, async (t) => {
        const w = await world(t)
        const key = `leak-${status}`
        const insert = (note: string): string => `INSERT INTO ${payTable} (key, note) VALUES ('${key}', '${note}')`
        let kept!: pg.PoolClient
        let releaseInside: unknown = null
        let inFlight: Promise<unknown> = Promise.resolve()
        w.app.post('/leak', async (request, reply) => {
          kept = poolClientOf(request)
          await kept.query('SELECT 1')
          try { kept.release() } catch (err) { releaseInside = err }
          // Sent now and not awaited: node-postgres sends a query when query() is called (postgres.js
          // when it is awaited), so this one runs inside the transaction, ahead of its COMMIT or ROLLBACK.
          inFlight = kept.query(`INSERT INTO ${payTable} (key, note) SELECT '${key}', 'in flight' FROM pg_sleep(0.05)`).catch((err: unknown) => err)
          return reply.code(status).send({ status })
        })

        t.equal((await w.post('/leak', key)).statusCode, status)
        t.match(String(releaseInside), /the store releases it when the transaction ends/, 'release() inside the transaction throws')
        t.notOk(await inFlight instanceof Error, 'the query sent before the end ran, in the transaction')
        await sleep(50) // the transaction has ended, and the client is back in the pool

        await t.rejects(kept.query(insert('promise')), /transaction has ended/, 'query(text) is refused')
        await t.rejects(kept.query({ text: `INSERT INTO ${payTable} (key, note) VALUES ($1, $2)`, values: [key, 'config'] }), /transaction has ended/, 'query(config) is refused')
        const viaCallback = await new Promise<Error | undefined>((resolve) => { kept.query(insert('callback'), (err) => resolve(err)) })
        t.match(String(viaCallback), /transaction has ended/, 'query(text, callback) is refused through its callback')
        const viaValuesCallback = await new Promise<Error | undefined>((resolve) => {
          kept.query(`INSERT INTO ${payTable} (key, note) VALUES ($1, $2)`, [key, 'values callback'], (err) => resolve(err))
        })
        t.match(String(viaValuesCallback), /transaction has ended/, 'query(text, values, callback) is refused through its callback')

        // A submittable (pg.Query here; pg-cursor and pg-query-stream are the same shape) gets the
        // refusal as its error, and is never submitted to the connection.
        const submittable = new pg.Query(insert('submittable'))
        let submitted = false
        const submit = submittable.submit.bind(submittable)
        submittable.submit = (connection) => { submitted = true; return submit(connection) }
        // Bounded: if it were run instead, it would end (or hang on a client back in the pool).
        const viaSubmittable = await new Promise<Error | 'ended' | 'no answer'>((resolve) => {
          setTimeout(() => resolve('no answer'), 2000).unref()
          kept.query(submittable).on('error', resolve).on('end', () => resolve('ended'))
        })
        t.match(String(viaSubmittable), /transaction has ended/, 'query(submittable) is refused through its error event')
        t.notOk(submitted, 'the submittable was never submitted')

        t.throws(() => { kept.release() }, /the store releases it when the transaction ends/, 'release() after the end throws too')
        await sleep(100)
        const notes = (await admin`SELECT note FROM ${admin(schema)}.payments WHERE key = ${key} ORDER BY note`).map((row) => String(row.note))
        t.same(notes, status === 201 ? ['in flight'] : [], 'only the query sent inside the transaction, and only if it committed')
        const counts = await settledCounts(poolLike(sql))
        t.equal(counts.idle, counts.total, `the client went back to the pool once, not released by the handler (${JSON.stringify(counts)})`)
        t.equal(w.store.openTransactions, 0, 'the transaction ended')
      })
    }
  }

  t.test('case 9: a COMMIT slower than storeTimeout answers "outcome unknown" (503), never "rolled back"; the retry replays the truth', async (t) => {
    const w = await world(t, { storeTimeout: 200 })
    let runs = 0
    w.app.post('/slow-commit', async (request, reply) => {
      runs++
      await exec(transactionOf(request), `INSERT INTO ${payTable} (key, note) VALUES ('slow-commit', 'slow')`)
      return reply.code(201).send({ paid: true })
    })
    const first = await w.post('/slow-commit', 'slow-commit')
    t.equal(first.statusCode, 503)
    t.equal(first.json().type, 'tag:fastify-idempotency,2026:outcome-unknown')
    t.equal(first.headers['retry-after'], '1')
    t.notMatch(first.body, /rolled back/, 'no claim of a rollback')
    await sleep(800) // the COMMIT completes
    const retry = await w.post('/slow-commit', 'slow-commit')
    t.equal(retry.statusCode, 201)
    t.equal(retry.headers['idempotent-replayed'], 'true', 'it had committed: the retry replays it')
    t.same(retry.json(), { paid: true })
    t.equal(runs, 1)
    t.equal(await payments('slow-commit'), 1)
  })

  t.test('case 10: a stream of string chunks is recorded and committed, and replayed', async (t) => {
    const w = await world(t)
    let runs = 0
    w.app.post('/strings', async (request, reply) => {
      runs++
      await exec(transactionOf(request), `INSERT INTO ${payTable} (key) VALUES ('strings')`)
      reply.code(201).type('text/plain')
      return Readable.from(['a', 'b', 'é'])
    })
    const first = await w.post('/strings', 'strings')
    t.equal(first.statusCode, 201)
    t.equal(first.body, 'abé')
    const replay = await w.post('/strings', 'strings')
    t.equal(replay.headers['idempotent-replayed'], 'true')
    t.equal(replay.body, 'abé')
    t.equal(runs, 1)
    t.equal(await payments('strings'), 1)
  })
}
