import Fastify, { type FastifyInstance } from 'fastify'
import type pg from 'pg'
import postgres from 'postgres'
import t, { type Test } from 'tap'
import idempotency from '../../lib/index.js'
import { postgresStore } from '../../drivers/postgres/index.js'
import { CLIENT, CLIENT_NAME, endPools, exec, poolLike, storeConnection } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The handle a transactional step's `fn` receives (`step(name, fn, { transaction: true })`, lease
 * mode): the step's transaction on the client under test, a guarded postgres.js TransactionSql or a
 * guarded node-postgres PoolClient inside BEGIN. Once the step's transaction is over it must send
 * nothing: by then its connection is back in the pool, and a write sent through it would commit on
 * its own, outside the step (after a rollback, an effect the step's failure said did not happen), or
 * inside whatever transaction holds the connection next. The node-postgres run:
 * test/postgres/node-postgres/step-handle.test.ts.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/step-handle.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const { name: schema, sql } = postgresSchema(t, url, {
    prefix: 'idem_step_handle',
    client: { max: 10, fetch_types: false },
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.writes (key text NOT NULL, note text NOT NULL)`
  })
  let tables = 0
  /** The test's table of written rows, quoted for `exec` (the schema's name is [a-z0-9_]). */
  const writes = `"${schema}".writes`

  t.teardown(endPools)

  const notes = async (key: string): Promise<string[]> =>
    (await sql<Array<{ note: string }>>`SELECT note FROM ${sql(schema)}.writes WHERE key = ${key} ORDER BY note`).map((row) => row.note)

  async function appWith (t: Test, route: (app: FastifyInstance) => void): Promise<FastifyInstance> {
    const store = postgresStore({ ...storeConnection(sql), schema, table: `records_${++tables}`, purgeInterval: 0 })
    await store.migrate()
    const app = Fastify()
    t.teardown(async () => { await app.close(); await store.close() })
    await app.register(idempotency, { store, scope: () => 'acct_a', lease: 1000 })
    route(app)
    return app
  }

  const post = (app: FastifyInstance, key: string) => app.inject({ method: 'POST', url: '/step', headers: { 'idempotency-key': `"${key}"` } })

  t.test(`a step's handle kept past the step refuses every query; nothing reaches the database (${CLIENT_NAME})`, async (t) => {
    let kept: unknown = null
    const app = await appWith(t, (app) => {
      app.post('/step', async (request) => {
        const context = request.idempotency
        if (context === null) throw new Error('unprotected')
        await context.step('write', async (tx) => {
          kept = tx
          await exec(tx, `INSERT INTO ${writes} VALUES ($1, 'in the step')`, [context.key])
        }, { transaction: true })
        return { ok: true }
      })
    })
    t.equal((await post(app, 'kept')).statusCode, 200)
    await t.rejects(exec(kept, `INSERT INTO ${writes} VALUES ('kept', 'after the step')`), { message: /transaction has ended/ }, 'a query with parameters')
    if (CLIENT === 'postgres') {
      const tx = kept as postgres.TransactionSql
      // postgres.js's guard throws when the query is built (node-postgres's answers through the promise or callback).
      await t.rejects(async () => await tx`INSERT INTO ${tx(schema)}.writes VALUES ('kept', 'tagged, after the step')`, { message: /transaction has ended/ }, 'a tagged template')
    } else {
      const client = kept as pg.PoolClient
      const refused = await new Promise<Error | null>((resolve) => {
        client.query(`INSERT INTO ${writes} VALUES ('kept', 'callback, after the step')`, (err) => { resolve(err) })
      })
      t.match(refused, { message: /transaction has ended/ }, 'a callback-style query gets the refusal in its callback')
      t.throws(() => { client.release() }, { message: /the store releases it/ }, 'release() is refused: the store already released it')
      const pool = poolLike(sql)
      t.equal(pool.totalCount - pool.idleCount, 0, 'the step\'s client went back to the pool, once')
    }
    t.same(await notes('kept'), ['in the step'], 'only the step\'s own write, committed with it')
  })

  /**
   * The step's code goes on writing after `fn` returned (or threw): a write it started without
   * awaiting, or the loser of a Promise.race. Each write is labelled with whether `fn` had settled
   * when it was sent. Those sent before commit (or roll back) with the step; every one sent after
   * must be refused, whether it comes while the step's record is written, while COMMIT or ROLLBACK is
   * in flight, or after the connection went back to the pool.
   */
  async function afterSettled (t: Test, outcome: 'returns' | 'throws'): Promise<void> {
    let settled = false
    let sentAfter = 0
    let refusal: unknown = null
    let writer: Promise<void> = Promise.resolve()
    const app = await appWith(t, (app) => {
      app.post('/step', async (request) => {
        const context = request.idempotency
        if (context === null) throw new Error('unprotected')
        await context.step('write', async (tx) => {
          writer = (async () => {
            for (let i = 0; i < 1000; i++) {
              if (settled) sentAfter++
              try {
                await exec(tx, `INSERT INTO ${writes} VALUES ($1, $2)`, [context.key, settled ? `after ${i}` : `before ${i}`])
              } catch (err) {
                refusal = err
                return
              }
            }
          })()
          // One write of the loop is in flight, or done, when fn settles.
          await exec(tx, 'SELECT 1')
          settled = true
          if (outcome === 'throws') throw new Error('the step failed')
        }, { transaction: true })
        return { ok: true }
      })
    })
    const key = `settled-${outcome}`
    t.equal((await post(app, key)).statusCode, outcome === 'returns' ? 200 : 500)
    // Bounded: on postgres.js a query sent on the handle after its COMMIT is never answered.
    const answered = await Promise.race([writer.then(() => true), sleep(5000).then(() => false)])
    t.ok(answered, 'every write the step\'s code sent was answered or refused')
    t.ok(sentAfter >= 1, 'the step\'s code tried to write after fn settled')
    t.match(refusal, { message: /transaction has ended/ }, 'and was refused')
    const written = await notes(key)
    t.same(written.filter((note) => note.startsWith('after')), [], 'no write sent after fn settled reached the database')
    if (outcome === 'returns') {
      t.ok(written.length >= 1, 'the writes sent while fn ran committed with the step')
    } else {
      t.same(written, [], 'the writes sent while fn ran rolled back with it')
    }
  }

  t.test(`a step's code writing after fn returned: refused, only fn's own writes commit (${CLIENT_NAME})`, async (t) => { await afterSettled(t, 'returns') })
  t.test(`a step's code writing after fn threw: refused, nothing is left written (${CLIENT_NAME})`, async (t) => { await afterSettled(t, 'throws') })

  t.test(`a step whose fn ends its own transaction is not recorded, and counts as taken effect: the key is held, the handler runs once (${CLIENT_NAME})`, async (t) => {
    for (const ending of ['COMMIT', 'ROLLBACK']) {
      let runs = 0
      const app = await appWith(t, (app) => {
        app.post('/step', async (request) => {
          runs++
          const context = request.idempotency
          if (context === null) throw new Error('unprotected')
          await context.step('write', async (tx) => {
            await exec(tx, `INSERT INTO ${writes} VALUES ($1, 'before the end')`, [context.key])
            await exec(tx, ending, [])
          }, { transaction: true })
          return { ok: true }
        })
      })
      const key = `ends-${ending}`
      const first = await post(app, key)
      t.equal(first.statusCode, 500, `${ending}: the step failed`)
      t.match(JSON.parse(first.body), { code: 'FST_IDEMPOTENCY_TRANSACTION_ENDED', message: /step "write"/ }, `${ending}: the error names the step`)
      await sleep(50)
      const retry = await post(app, key)
      t.equal(retry.statusCode, 409, `${ending}: the key is held (what fn wrote may have committed), not released for a retry to run again`)
      t.equal(runs, 1, `${ending}: the handler ran once`)
      t.ok((await notes(key)).length <= 1, `${ending}: the write exists at most once`)
    }
  })
}
