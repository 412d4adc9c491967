import { randomBytes } from 'node:crypto'
import Fastify, { type FastifyInstance } from 'fastify'
import postgres, { type TransactionSql } from 'postgres'
import t, { type Test } from 'tap'
import idempotency from '../../lib/index.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Each way atomic mode could write on a transaction's connection after PostgreSQL dropped it, one
 * at a time: the backend is terminated while the handler waits, and the test lets the handler go
 * on only once postgres.js has noticed (the store no longer counts the transaction as open). On
 * postgres.js 3.4.9 any statement sent from there crashes this process (`TypeError … at
 * Immediate.nextWrite`, porsager/postgres#1208), so each check also needs the process alive.
 * test/postgres/dropped-connection.test.ts does the same at random, in a child process.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/dropped-connection-paths.test.ts` (it provisions a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

const TYPE_BASE = 'tag:fastify-idempotency,2026:'
/** An error of another connection (a fetch's ECONNRESET): it says nothing of the transaction's. */
const foreign = (): Error => Object.assign(new Error('read ECONNRESET (another service)'), { code: 'ECONNRESET', syscall: 'read' })

/** What a handler does once its connection is gone: given the handle (or a savepoint's) it wrote through. */
type Continuation = (tx: TransactionSql<any>) => Promise<unknown>

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const application = `idem-dropped-paths-${id}`
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_dropped_paths',
    client: { max: 2 },
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.payments (id serial PRIMARY KEY, key text NOT NULL)`
  })
  const sql = postgres(url, { max: 2, fetch_types: false, backoff: () => 0.01, onnotice: () => {}, connection: { application_name: application } })
  let store: PostgresStore
  let app: FastifyInstance
  /** The scenario of the next request: what runs after the connection dropped, and whether inside a savepoint. */
  let scenario: { continuation: Continuation, inSavepoint: boolean } | null = null
  let held: ((pid: number) => void) | null = null
  let resume: (() => void) | null = null
  let sleeping: ((pid: number) => void) | null = null
  const failures: unknown[] = []

  t.before(async () => {
    store = postgresStore({ sql, schema, table: 'records', purgeInterval: 0 })
    await store.migrate()
    app = Fastify()
    await app.register(idempotency, { store, scope: () => 'test', transaction: true, storeTimeout: 2_000 })
    app.post('/pay', async (request, reply) => {
      const tx = request.idempotency?.sql as TransactionSql<any>
      const key = request.idempotency?.key as string
      const current = scenario
      const write = async (handle: TransactionSql<any>): Promise<unknown> => {
        const [row] = await handle<Array<{ pid: number }>>`INSERT INTO ${handle(schema)}.payments (key) VALUES (${key}) RETURNING pg_backend_pid() AS pid`
        if (current === null) return
        await new Promise<void>((resolve) => { resume = resolve; held?.(row?.pid ?? 0) })
        try {
          return await current.continuation(handle)
        } catch (err) {
          failures.push(err)
          throw err
        }
      }
      await (current?.inSavepoint === true ? tx.savepoint((savepoint) => write(savepoint)) : write(tx))
      return reply.code(201).send({ key })
    })
    app.post('/sleeping', async (request, reply) => {
      const tx = request.idempotency?.sql as TransactionSql<any>
      const [row] = await tx<Array<{ pid: number }>>`INSERT INTO ${tx(schema)}.payments (key) VALUES (${request.idempotency?.key ?? ''}) RETURNING pg_backend_pid() AS pid`
      sleeping?.(row?.pid ?? 0)
      try {
        await tx`SELECT pg_sleep(30)`
      } catch (err) {
        failures.push(err)
        // In the same turn as the failure: the connection closed a moment ago.
        try {
          await tx`SELECT 2`
        } catch (again) {
          failures.push(again)
          throw again
        }
      }
      return reply.code(201).send({})
    })
    // Lease mode, a step in its own transaction (drivers/postgres/recovery.ts): the same defect.
    type TransactionalStep = (name: string, fn: (tx: TransactionSql<any>) => Promise<unknown>, options: { transaction: true }) => Promise<unknown>
    // A short lease: the release of a failed attempt can itself fail here, when it is the first
    // statement of a pool connection that reconnected after dying mid-query (postgres.js 3.4.9
    // keeps that session's FATAL 57P01 and fails the next session's first query with it); the key
    // then frees itself when its lease expires, as documented, and the retry takes it over.
    app.post('/step', { config: { idempotency: { transaction: false, lease: 300 } } }, async (request, reply) => {
      const step = request.idempotency?.step as unknown as TransactionalStep
      const key = request.idempotency?.key as string
      const current = scenario
      await step.call(request.idempotency, 'charge', async (tx) => {
        const [row] = await tx<Array<{ pid: number }>>`INSERT INTO ${tx(schema)}.payments (key) VALUES (${key}) RETURNING pg_backend_pid() AS pid`
        if (current === null) return null
        await new Promise<void>((resolve) => { resume = resolve; held?.(row?.pid ?? 0) })
        try {
          return await current.continuation(tx)
        } catch (err) {
          failures.push(err)
          throw err
        }
      }, { transaction: true })
      return reply.code(201).send({ key })
    })
    // An error of the savepoint's own that looks like a connection error (see the last tests).
    app.post('/foreign-savepoint', async (request, reply) => {
      const tx = request.idempotency?.sql as TransactionSql<any>
      const key = request.idempotency?.key as string
      await tx`INSERT INTO ${tx(schema)}.payments (key) VALUES (${key})`
      const caught = await tx.savepoint(async (savepoint) => {
        await savepoint`INSERT INTO ${savepoint(schema)}.payments (key) VALUES (${key})`
        throw foreign()
      }).catch((err: unknown) => err)
      return reply.code(201).send({ code: (caught as { code?: unknown }).code })
    })
    await app.ready()
  })
  t.teardown(async () => {
    await app?.close()
    await sql.end({ timeout: 2 })
  })

  /**
   * One request whose backend is terminated while its handler waits; the handler goes on once
   * postgres.js has reported the connection closed (sql.begin settled: the store counts 0 open).
   */
  async function dropUnder (t: Test, key: string, continuation: Continuation, inSavepoint = false): Promise<{ status: number, type: string | null }> {
    scenario = { continuation, inSavepoint }
    failures.length = 0
    const pid = new Promise<number>((resolve) => { held = resolve })
    const answer = app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': `"${key}"` } })
    const backend = await pid
    const [terminated] = await admin`SELECT pg_terminate_backend(${backend}) AS done`
    t.equal(terminated?.done, true, 'the backend of the open transaction was terminated')
    for (let i = 0; i < 200 && store.openTransactions > 0; i++) await sleep(10)
    t.equal(store.openTransactions, 0, 'postgres.js reported the connection closed')
    await sleep(20)
    resume?.()
    const response = await answer
    const body = JSON.parse(response.body) as { type?: string }
    return { status: response.statusCode, type: typeof body.type === 'string' ? body.type.slice(TYPE_BASE.length) : null }
  }

  /** A request after the drop: a fresh connection, a fresh transaction. */
  async function stillServing (t: Test, key: string): Promise<void> {
    scenario = null
    const response = await app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': `"${key}"` } })
    t.equal(response.statusCode, 201, 'the process is alive and the next request commits')
    const rows = await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.payments WHERE key = ${key}`
    t.equal(rows[0]?.n, 1, 'its payment committed')
  }

  const rowsOf = async (key: string): Promise<number> => (await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.payments WHERE key = ${key}`)[0]?.n as number

  t.test('the handler returns after its connection dropped: no response is written, COMMIT is never sent, the client gets 500 not-committed', async (t) => {
    const answer = await dropUnder(t, 'returns', async () => {})
    t.same(answer, { status: 500, type: 'not-committed' })
    t.equal(await rowsOf('returns'), 0, 'nothing committed')
    await stillServing(t, 'returns-after')
  })

  t.test('the handler queries again after its connection dropped: refused with CONNECTION_CLOSED, not written to the closed socket', async (t) => {
    const answer = await dropUnder(t, 'queries', async (tx) => await tx`SELECT 1`)
    t.equal(answer.status, 500, 'the handler\'s error: rolled back')
    t.equal((failures[0] as { code?: unknown } | undefined)?.code, 'CONNECTION_CLOSED', 'the handler saw the code postgres.js gives a closed connection')
    t.match(String(failures[0]), /connection of this request's transaction closed/)
    t.equal(await rowsOf('queries'), 0, 'nothing committed')
    await stillServing(t, 'queries-after')
  })

  t.test('the handler catches that error and goes on with more queries: every one refused', async (t) => {
    let refused = 0
    const answer = await dropUnder(t, 'persists', async (tx) => {
      for (const query of [() => tx`SELECT ${1}::int`, () => tx`SELECT 2`, () => tx.unsafe('SELECT 3'), () => tx.savepoint(async (savepoint) => await savepoint`SELECT 4`)]) {
        try { await query() } catch (err) { if ((err as { code?: unknown }).code === 'CONNECTION_CLOSED') refused++ }
      }
    })
    t.equal(refused, 4, 'four queries refused')
    t.same(answer, { status: 500, type: 'not-committed' }, 'its 201 was not committed')
    await stillServing(t, 'persists-after')
  })

  t.test('inside a savepoint: the savepoint\'s query is refused and no ROLLBACK TO SAVEPOINT is sent; the handler gets the error', async (t) => {
    const answer = await dropUnder(t, 'savepoint', async (savepoint) => await savepoint`SELECT 1`, true)
    t.equal(answer.status, 500, 'the handler\'s error: rolled back')
    t.equal((failures[0] as { code?: unknown } | undefined)?.code, 'CONNECTION_CLOSED')
    t.equal(await rowsOf('savepoint'), 0, 'nothing committed')
    await stillServing(t, 'savepoint-after')
  })

  t.test('a query in flight when the connection drops fails with it, and the query sent in reaction to that failure is refused', async (t) => {
    failures.length = 0
    const pid = new Promise<number>((resolve) => { sleeping = resolve })
    const answer = app.inject({ method: 'POST', url: '/sleeping', headers: { 'idempotency-key': '"sleeping"' } })
    const backend = await pid
    for (let i = 0; i < 200; i++) {
      const [row] = await admin`SELECT state FROM pg_stat_activity WHERE pid = ${backend}`
      if (row?.state === 'active') break
      await sleep(10)
    }
    const [terminated] = await admin`SELECT pg_terminate_backend(${backend}) AS done`
    t.equal(terminated?.done, true, 'terminated during pg_sleep')
    const response = await answer
    t.equal(response.statusCode, 500, 'the handler\'s error: rolled back')
    t.equal(failures.length, 2, 'the query in flight failed, then the one sent in reaction')
    t.equal((failures[1] as { code?: unknown } | undefined)?.code, 'CONNECTION_CLOSED')
    t.match(String(failures[1]), /connection of this request's transaction closed/, 'refused by the driver, not sent')
    t.equal(await rowsOf('sleeping'), 0, 'nothing committed')
    await stillServing(t, 'sleeping-after')
  })

  t.test('lease mode, a step in a transaction: its next query after the drop is refused, nothing is sent, and the retry runs the step afresh', async (t) => {
    scenario = { continuation: async (tx) => await tx`SELECT 1`, inSavepoint: false }
    failures.length = 0
    const pid = new Promise<number>((resolve) => { held = resolve })
    const answer = app.inject({ method: 'POST', url: '/step', headers: { 'idempotency-key': '"step"' } })
    const backend = await pid
    const [terminated] = await admin`SELECT pg_terminate_backend(${backend}) AS done`
    t.equal(terminated?.done, true, 'the backend of the step\'s transaction was terminated')
    for (let i = 0; i < 200; i++) {
      if ((await admin`SELECT 1 FROM pg_stat_activity WHERE pid = ${backend}`).length === 0) break
      await sleep(10)
    }
    // The backend is gone; a moment more for its close to reach the client.
    await sleep(100)
    resume?.()
    const response = await answer
    t.equal(response.statusCode, 500, 'the step failed: the handler\'s error')
    // The step's call already failed with the connection (sql.begin settled), so the handle counts
    // its transaction as ended, and says so; either way the query was not sent.
    t.match(String(failures[0]), /transaction has ended|transaction closed/, 'the step\'s query was refused by the driver, not sent')
    t.equal(await rowsOf('step'), 0, 'the step\'s write was rolled back with its connection')
    scenario = null
    // A client's retry: 409 until the failed attempt's release (or lease expiry, above) frees the key.
    let retry = await app.inject({ method: 'POST', url: '/step', headers: { 'idempotency-key': '"step"' } })
    for (let i = 0; i < 100 && retry.statusCode === 409; i++) {
      await sleep(20)
      retry = await app.inject({ method: 'POST', url: '/step', headers: { 'idempotency-key': '"step"' } })
    }
    t.equal(retry.statusCode, 201, 'the process is alive; the retry runs the step afresh')
    t.equal(await rowsOf('step'), 1, 'one execution')
  })

  // Guards of the other side: only this transaction's own statements say its connection is lost.
  // An error of the handler's own that looks like a connection error (a fetch's ECONNRESET) must
  // not leave a live transaction open forever.

  t.test('a step whose fn fails with another connection\'s error rolls back as usual, and its connection serves again', async (t) => {
    scenario = { continuation: async () => { throw foreign() }, inSavepoint: false }
    const pid = new Promise<number>((resolve) => { held = resolve })
    const answer = app.inject({ method: 'POST', url: '/step', headers: { 'idempotency-key': '"foreign-step"' } })
    const backend = await pid
    resume?.()
    const response = await answer
    t.equal(response.statusCode, 500)
    t.equal(await rowsOf('foreign-step'), 0, 'rolled back')
    let state: unknown = 'idle in transaction'
    for (let i = 0; i < 100 && state !== 'idle'; i++) {
      state = (await admin`SELECT state FROM pg_stat_activity WHERE pid = ${backend}`)[0]?.state
      if (state !== 'idle') await sleep(10)
    }
    t.equal(state, 'idle', 'ROLLBACK was sent: the connection is idle, not left in its transaction')
  })

  t.test('a savepoint whose fn fails with another connection\'s error is rolled back to, and the request commits', async (t) => {
    scenario = null
    const response = await app.inject({ method: 'POST', url: '/foreign-savepoint', headers: { 'idempotency-key': '"foreign-savepoint"' } })
    t.same([response.statusCode, JSON.parse(response.body)], [201, { code: 'ECONNRESET' }], 'the handler got its error and went on')
    t.equal(await rowsOf('foreign-savepoint'), 1, 'the savepoint\'s row was rolled back to, the other committed')
    t.equal(store.openTransactions, 0)
  })

  t.test('the reconciler\'s lock connection drops during a pass: no COMMIT is sent on it, the pass reports the error, the process lives', async (t) => {
    // A client of its own, with connections to spare: the passes that follow use live ones, so
    // nothing reconnects the dropped one under the pass still running on it.
    const own = postgres(url, { max: 4, fetch_types: false, backoff: () => 0.01, onnotice: () => {}, connection: { application_name: `${application}-r` } })
    t.teardown(async () => { await own.end({ timeout: 1 }) })
    const reconciling = postgresStore({ sql: own, schema, table: 'records', purgeInterval: 0 })
    const stuck = await reconciling.claim({ scope: 'test', key: 'reconciler-stuck', fingerprint: { algorithm: 'canonical-v1', digest: Buffer.alloc(32) }, leaseMs: 1, ttlMs: 60_000 })
    t.equal(stuck.outcome, 'acquired', 'a record whose owner will not come back')
    await sleep(20)
    let entered!: () => void
    const inPass = new Promise<void>((resolve) => { entered = resolve })
    let open!: () => void
    const gate = new Promise<void>((resolve) => { open = resolve })
    let left!: () => void
    const passEnding = new Promise<void>((resolve) => { left = resolve })
    const errors: unknown[] = []
    const reconciler = reconciling.startReconciler({
      interval: 20,
      olderThan: 0,
      resolve: async () => { entered(); await gate; setTimeout(left, 0); return undefined },
      onError: (err) => { errors.push(err) }
    })
    await inPass
    const [lock] = await admin`SELECT pid FROM pg_stat_activity WHERE application_name = ${`${application}-r`} AND state = 'idle in transaction'`
    t.ok(lock !== undefined, 'the pass holds its lock transaction')
    const [terminated] = await admin`SELECT pg_terminate_backend(${lock?.pid ?? 0}) AS done`
    t.equal(terminated?.done, true)
    for (let i = 0; i < 200; i++) {
      if ((await admin`SELECT 1 FROM pg_stat_activity WHERE pid = ${lock?.pid ?? 0}`).length === 0) break
      await sleep(10)
    }
    await sleep(100)
    open()
    // stop() does not wait for the pass: sql.begin already failed with the connection. The pass's
    // last statements and its transaction's end come right after `resolve` returned.
    await passEnding
    await sleep(200)
    await reconciler.stop()
    t.ok(errors.some((err) => (err as { code?: unknown }).code === 'CONNECTION_CLOSED'), 'the pass reported its lock connection closed')
    const [row] = await own`SELECT 1 AS one`
    t.equal(row?.one, 1, 'the process is alive and the pool serves')
  })
}
