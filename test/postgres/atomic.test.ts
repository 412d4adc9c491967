import { spawn } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import http from 'node:http'
import type { AddressInfo } from 'node:net'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import Fastify, { type FastifyInstance } from 'fastify'
import postgres from 'postgres'
import t, { type Test } from 'tap'
import idempotency, { InvalidOptionError, memoryStore, type IdempotencyOptions } from '../../lib/index.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { keyLock } from '../../drivers/postgres/statements.js'
import { CLIENT, endPools, exec, poolLike, storeConnection } from '../helpers/postgres-clients.js'
import { everySlotFree, settledCounts } from '../helpers/pool-accounting.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Atomic mode against a real PostgreSQL (DATABASE_URL): the claim, the handler's writes through
 * request.idempotency.sql and the recorded response commit together or roll back together. The
 * store runs on the client under test (test/helpers/postgres-clients.ts); the handlers write with
 * `exec`, which takes either client's transaction handle; the checks read with postgres.js.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/atomic.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

const FIXTURE = fileURLToPath(new URL('../fixtures/postgres-atomic-server.ts', import.meta.url))
const keyed = (key: string): Record<string, string> => ({ 'idempotency-key': `"${key}"`, 'content-type': 'application/json' })
function deferred (): { promise: Promise<void>, resolve: () => void } {
  let resolve!: () => void
  const promise = new Promise<void>((_resolve) => { resolve = _resolve })
  return { promise, resolve }
}
/**
 * Open transactions once the ones in flight have ended: a request that was answered from a
 * committed record still rolls its own (read-only) transaction back just after it answered.
 */
async function drained (store: PostgresStore): Promise<number> {
  for (let i = 0; i < 300 && store.openTransactions > 0; i++) await sleep(10)
  return store.openTransactions
}

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const appName = `idem-atomic-${id}`
  const sql = postgres(url, { max: 10, onnotice: () => {}, connection: { application_name: appName } })
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_atomic',
    client: { max: 2 },
    migrate: ['records'],
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.payments (key text NOT NULL, amount integer NOT NULL,
      ref text UNIQUE DEFERRABLE INITIALLY DEFERRED)`
  })
  const payTable = `"${schema}".payments`
  t.teardown(async () => {
    await sql.end({ timeout: 2 })
    await endPools()
  })

  async function reset (): Promise<void> {
    await admin`TRUNCATE ${admin(schema)}.payments, ${admin(schema)}.records`
  }
  const payments = async (key: string): Promise<number> =>
    Number((await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.payments WHERE key = ${key}`)[0]?.n)
  const records = async (key: string): Promise<string[]> =>
    (await admin`SELECT state FROM ${admin(schema)}.records WHERE key = ${key}`).map((row) => String(row.state))
  const idleInTransactionNow = async (): Promise<number> =>
    Number((await admin`SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = ${appName} AND state LIKE 'idle in transaction%'`)[0]?.n)
  /**
   * Backends idle in a transaction, once those whose client was just destroyed (release(err)
   * closes the socket; the backend ends when it reads that) have gone: a transaction that leaked
   * stays, and is counted after 2 s.
   */
  async function idleInTransaction (): Promise<number> {
    for (let i = 0; i < 200; i++) {
      const n = await idleInTransactionNow()
      if (n === 0) return 0
      await sleep(10)
    }
    return idleInTransactionNow()
  }

  interface World { app: FastifyInstance, store: PostgresStore, runs: () => number }

  /** An app whose POST /pay inserts a payment through request.idempotency.sql; `behave` decides what else it does. */
  async function world (t: Test, options: IdempotencyOptions = {}, behave: (body: { amount: number, fail?: string, ref?: string }) => Promise<void> | void = () => {}): Promise<World> {
    await reset()
    const store = postgresStore({ ...storeConnection(sql), schema, table: 'records', purgeInterval: 0 })
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'test', transaction: true, ...options })
    let runs = 0
    app.post<{ Body: { amount: number, fail?: string, ref?: string } }>('/pay', async (request, reply) => {
      runs++
      const tx = request.idempotency?.sql
      if (tx === undefined) throw new Error('no transaction')
      const key = request.idempotency?.key ?? ''
      await exec(tx, `INSERT INTO ${payTable} (key, amount, ref) VALUES ($1, $2, $3)`, [key, request.body.amount, request.body.ref ?? null])
      await behave(request.body)
      if (request.body.fail === 'throw') throw new Error('card network exploded')
      if (request.body.fail === '500') return reply.code(500).send({ error: 'oops' })
      return reply.code(201).header('location', `/payments/${key}`).send({ key, amount: request.body.amount, run: runs })
    })
    return { app, store, runs: () => runs }
  }

  /** Holds an ACCESS EXCLUSIVE lock on the records table until `release`, as a DDL statement would. */
  async function lockRecordsTable (t: Test): Promise<{ release: () => Promise<void> }> {
    return await holding(t, async (tx) => { await tx`LOCK TABLE ${tx(schema)}.records IN ACCESS EXCLUSIVE MODE` })
  }

  /** Holds the advisory lock every atomic claim of (test, key) tries (statements.ts, keyLock) until `release`. */
  async function lockKey (t: Test, key: string): Promise<{ release: () => Promise<void> }> {
    return await holding(t, async (tx) => { await tx`SELECT pg_advisory_xact_lock(${keyLock('test', key)}::int8)` })
  }

  async function holding (t: Test, take: (tx: postgres.TransactionSql) => Promise<void>): Promise<{ release: () => Promise<void> }> {
    const released = deferred()
    const locked = deferred()
    const locker = admin.begin(async (tx) => {
      await take(tx)
      locked.resolve()
      await released.promise
    })
    t.teardown(() => released.resolve())
    await locked.promise
    return { release: async () => { released.resolve(); await locker } }
  }

  /** A completed record for (test, key) past its ttl: the next claim reclaims it as a fresh key. */
  async function plantExpired (key: string): Promise<void> {
    await admin.unsafe(`INSERT INTO "${schema}".records (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, expires_at,
      response_status, response_headers, response_body) VALUES ('test', $1, $2, 'test', 'completed', gen_random_uuid(), '-infinity', 201, '{}', 'old')`, [key, Buffer.alloc(32, 7)])
  }

  const pay = (app: FastifyInstance, key: string, body: object) =>
    app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: body })

  t.test('the payment row and the recorded response commit together; a retry replays without running', async (t) => {
    const w = await world(t)
    const first = await pay(w.app, 'k1', { amount: 100 })
    t.equal(first.statusCode, 201)
    t.equal(first.headers['idempotent-replayed'], undefined)
    t.equal(await payments('k1'), 1)
    t.same(await records('k1'), ['completed'])
    const retry = await pay(w.app, 'k1', { amount: 100 })
    t.equal(retry.statusCode, 201)
    t.equal(retry.headers['idempotent-replayed'], 'true')
    t.equal(retry.body, first.body, 'byte-identical replay')
    t.equal(retry.headers.location, '/payments/k1')
    t.equal(w.runs(), 1)
    t.equal(await payments('k1'), 1, 'no second payment')
    t.equal(await drained(w.store), 0, 'no transaction left open')
  })

  t.test('a handler that writes its row and then throws leaves neither the row nor the key', async (t) => {
    const w = await world(t)
    const failed = await pay(w.app, 'k2', { amount: 100, fail: 'throw' })
    t.equal(failed.statusCode, 500)
    t.equal(await payments('k2'), 0, 'the payment rolled back')
    t.same(await records('k2'), [], 'the claim rolled back with it')
    const retry = await pay(w.app, 'k2', { amount: 100 })
    t.equal(retry.statusCode, 201, 'the retry executes')
    t.equal(w.runs(), 2)
    t.equal(await payments('k2'), 1)
  })

  t.test('a 5xx response (excluded by the record rule) rolls back the effect too', async (t) => {
    const w = await world(t)
    const failed = await pay(w.app, 'k3', { amount: 100, fail: '500' })
    t.equal(failed.statusCode, 500)
    t.same(failed.json(), { error: 'oops' }, 'the client gets the handler\'s own 500')
    t.equal(await payments('k3'), 0)
    t.same(await records('k3'), [])
    t.equal((await pay(w.app, 'k3', { amount: 100 })).statusCode, 201)
    t.equal(await payments('k3'), 1)
  })

  t.test('a failed COMMIT answers a 500 problem, never the handler\'s success body, and nothing stays', async (t) => {
    const w = await world(t)
    // `ref` is UNIQUE DEFERRABLE INITIALLY DEFERRED: a duplicate is only detected at COMMIT.
    await admin`INSERT INTO ${admin(schema)}.payments (key, amount, ref) VALUES ('other', 1, 'dup')`
    const failed = await pay(w.app, 'k4', { amount: 100, ref: 'dup' })
    t.equal(failed.statusCode, 500)
    t.match(failed.headers['content-type'], /^application\/problem\+json/)
    t.equal(failed.json().type, 'tag:fastify-idempotency,2026:not-committed')
    t.equal(failed.json().status, 500)
    t.equal(failed.headers.location, undefined, "none of the handler's headers leak")
    t.notMatch(failed.body, /"amount"/)
    t.equal(await payments('k4'), 0)
    t.same(await records('k4'), [])
    t.equal((await pay(w.app, 'k4', { amount: 100, ref: 'fresh' })).statusCode, 201, 'a corrected retry executes')
    t.equal(await drained(w.store), 0, 'no transaction left open')
  })

  t.test('50 simultaneous first requests: one execution; duplicates that waited replay the committed result', async (t) => {
    const w = await world(t, { wait: 10_000 }, async () => { await sleep(100) })
    const answers = await Promise.all(Array.from({ length: 50 }, () => pay(w.app, 'k5', { amount: 5 })))
    t.equal(w.runs(), 1)
    t.equal(await payments('k5'), 1)
    t.same(answers.map((a) => a.statusCode), Array(50).fill(201))
    t.equal(new Set(answers.map((a) => a.body)).size, 1, 'everyone got the same body')
    t.equal(answers.filter((a) => a.headers['idempotent-replayed'] === 'true').length, 49)
    t.equal(await drained(w.store), 0)
  })

  t.test('without wait, a duplicate of an uncommitted claim gets 409 at once; after the commit it replays or gets 422', async (t) => {
    const gate = deferred()
    const w = await world(t, {}, async () => { await gate.promise })
    const original = pay(w.app, 'k6', { amount: 6 })
    await sleep(100)
    const duplicate = await pay(w.app, 'k6', { amount: 6 })
    t.equal(duplicate.statusCode, 409)
    const different = await pay(w.app, 'k6', { amount: 7 })
    t.equal(different.statusCode, 409, 'in flight, an uncommitted fingerprint is invisible: 409 (documented)')
    gate.resolve()
    t.equal((await original).statusCode, 201)
    t.equal((await pay(w.app, 'k6', { amount: 7 })).statusCode, 422, 'after the commit, a different request is 422')
    t.equal((await pay(w.app, 'k6', { amount: 6 })).headers['idempotent-replayed'], 'true')
    t.equal(w.runs(), 1)
  })

  t.test('a claim that meets a lock that is no claim\'s (a table lock, as DDL takes) waits for it, and runs: no 409 for a key nobody holds', async (t) => {
    const w = await world(t)
    const lock = await lockRecordsTable(t)
    const answer = pay(w.app, 'k-lock', { amount: 1 })
    const waiting = async (): Promise<boolean> => (await admin`
      SELECT 1 FROM pg_locks WHERE relation = ${`"${schema}".records`}::regclass AND NOT granted`).length > 0
    for (let i = 0; i < 500 && !await waiting(); i++) await sleep(5)
    t.ok(await waiting(), 'the claim waits on the table lock')
    await lock.release()
    const response = await answer
    t.equal(response.statusCode, 201, 'the claim ran once the lock was gone')
    t.equal(w.runs(), 1)
    t.equal(await payments('k-lock'), 1)
    t.same(await records('k-lock'), ['completed'])
  })

  t.test('without wait, a duplicate of an original held by another instance is answered 409 at once, without waiting for its transaction', async (t) => {
    const gate = deferred()
    const entered = deferred()
    const a = await world(t, {}, async () => { entered.resolve(); await gate.promise })
    const b = await world(t)
    const original = pay(a.app, 'k-elsewhere', { amount: 5 })
    await entered.promise
    const duplicate = await pay(b.app, 'k-elsewhere', { amount: 5 })
    t.equal(duplicate.statusCode, 409, 'answered while the original is still in flight')
    t.equal(await drained(b.store), 0, 'the duplicate holds no transaction')
    gate.resolve()
    t.equal((await original).statusCode, 201)
    const replay = await pay(b.app, 'k-elsewhere', { amount: 5 })
    t.equal(replay.headers['idempotent-replayed'], 'true', 'after the commit, the duplicate replays')
    t.equal(a.runs() + b.runs(), 1, 'ran once')
    t.equal(await payments('k-elsewhere'), 1)
  })

  t.test('a claim that finds the key\'s lock taken answers from the record it sees: a completed one replays, an expired one is not reclaimed under the lock', async (t) => {
    const w = await world(t)
    const completed = await pay(w.app, 'k-done', { amount: 3 })
    t.equal(completed.statusCode, 201)
    const lock = await lockKey(t, 'k-done')
    const replay = await pay(w.app, 'k-done', { amount: 3 })
    t.equal(replay.statusCode, 201)
    t.equal(replay.headers['idempotent-replayed'], 'true', 'a duplicate holding the lock for a moment does not hide a completed record')
    t.equal(w.runs(), 1)
    await lock.release()

    // An expired record whose lock another transaction holds (a reclaim in flight): the claim
    // does not reclaim it (it would wait for that transaction's row lock), and answers 409.
    await plantExpired('k-old')
    const held = await lockKey(t, 'k-old')
    const busy = await pay(w.app, 'k-old', { amount: 4 })
    t.equal(busy.statusCode, 409)
    t.equal(w.runs(), 1, 'nothing ran')
    await held.release()
    const fresh = await pay(w.app, 'k-old', { amount: 4 })
    t.equal(fresh.statusCode, 201, 'once the lock is free, the expired record is reclaimed')
    t.equal(w.runs(), 2)
    t.same(await records('k-old'), ['completed'])
  })

  t.test('a client that goes away rolls the transaction back; the handler cannot write afterwards', async (t) => {
    let lateWrite: unknown = null
    const entered = deferred()
    const letGo = deferred()
    const w = await world(t, {}, async () => {
      entered.resolve()
      await letGo.promise
    })
    w.app.post<{ Body: { amount: number } }>('/late', async (request) => {
      const tx = request.idempotency?.sql
      if (tx === undefined) throw new Error('no transaction')
      await exec(tx, `INSERT INTO ${payTable} (key, amount) VALUES ('late-1', 1)`)
      entered.resolve()
      await letGo.promise
      try { await exec(tx, `INSERT INTO ${payTable} (key, amount) VALUES ('late-2', 2)`) } catch (err) { lateWrite = err }
      return { ok: true }
    })
    await w.app.listen({ host: '127.0.0.1', port: 0 })
    const port = (w.app.server.address() as AddressInfo).port
    const request = http.request({ host: '127.0.0.1', port, method: 'POST', path: '/late', headers: keyed('k7'), agent: false })
    request.on('error', () => {})
    request.end(JSON.stringify({ amount: 1 }))
    await entered.promise
    request.destroy()
    t.equal(await drained(w.store), 0, 'rolled back as soon as the client left')
    letGo.resolve()
    await sleep(100)
    t.match(String(lateWrite), /transaction has ended/, 'the handler\'s late query is refused, not run in autocommit')
    t.equal(await payments('late-1'), 0, 'the first write rolled back')
    t.equal(await payments('late-2'), 0, 'the late write never ran')
    t.same(await records('k7'), [])
  })

  t.test('a process killed mid-handler leaves nothing: the key executes again at once, without the half-done effect', async (t) => {
    await reset()
    const child = spawn(process.execPath, ['--import', 'tsx', FIXTURE], { env: { ...process.env, DATABASE_URL: url, IDEM_SCHEMA: schema }, stdio: ['ignore', 'pipe', 'inherit'] })
    t.teardown(() => { child.kill('SIGKILL') })
    const lines = createInterface({ input: child.stdout })
    const events: Array<Record<string, unknown>> = []
    const next = async (): Promise<Record<string, unknown>> => {
      for (let i = 0; i < 1000; i++) {
        const event = events.shift()
        if (event !== undefined) return event
        await sleep(10)
      }
      throw new Error('the fixture said nothing')
    }
    lines.on('line', (line) => events.push(JSON.parse(line) as Record<string, unknown>))
    const { port, client } = await next() as { port: number, client: string }
    t.equal(client, CLIENT, 'the fixture runs its store on the client under test')
    fetch(`http://127.0.0.1:${port}/pay`, { method: 'POST', headers: keyed('k8'), body: JSON.stringify({ amount: 8 }) }).catch(() => {})
    t.same(await next(), { held: 'k8' })
    t.equal(await payments('k8'), 0, 'the uncommitted payment is invisible')
    child.kill('SIGKILL')
    await new Promise((resolve) => child.once('exit', resolve))

    const w = await world(t, { wait: 5000 })
    await admin`INSERT INTO ${admin(schema)}.payments (key, amount) VALUES ('marker', 0)`
    const retry = await pay(w.app, 'k8', { amount: 8 })
    t.equal(retry.statusCode, 201, 'the retry executes (the server rolled the dead transaction back)')
    t.equal(await payments('k8'), 1, 'exactly one payment: the killed one left nothing')
    t.same(await records('k8'), ['completed'])
  })

  t.test('10,000 requests with random failures, aborts and timeouts leak no connection and no transaction', async (t) => {
    const w = await world(t, {}, async (body) => {
      if (body.fail === 'slow') await sleep(30)
    })
    const outcomes = ['ok', 'throw', '500', 'ok', 'ok']
    const batches = 100
    let sent = 0
    const counts = new Map<number, number>()
    for (let b = 0; b < batches; b++) {
      const batch = Array.from({ length: 95 }, (_, i) => {
        const fail = outcomes[(b * 95 + i) % outcomes.length]
        const key = `bulk-${b}-${i % 40}`
        return pay(w.app, key, { amount: 1, fail: fail === 'ok' ? undefined as unknown as string : fail })
      })
      sent += batch.length
      for (const answer of await Promise.all(batch)) counts.set(answer.statusCode, (counts.get(answer.statusCode) ?? 0) + 1)
    }
    // Aborts and socket timeouts need a real server.
    await w.app.listen({ host: '127.0.0.1', port: 0 })
    w.app.server.setTimeout(15)
    const port = (w.app.server.address() as AddressInfo).port
    const abort = (key: string, after: number): Promise<void> => new Promise((resolve) => {
      const request = http.request({ host: '127.0.0.1', port, method: 'POST', path: '/pay', headers: keyed(key), agent: false })
      request.on('error', () => resolve())
      request.on('response', (response) => { response.resume(); response.on('end', () => resolve()); response.on('error', () => resolve()) })
      request.on('close', () => resolve())
      request.end(JSON.stringify({ amount: 1, fail: 'slow' }))
      setTimeout(() => request.destroy(), after)
    })
    for (let b = 0; b < 10; b++) {
      await Promise.all(Array.from({ length: 50 }, (_, i) => abort(`abort-${b}-${i}`, i % 3 === 0 ? 1 : 10)))
      sent += 50
    }
    t.equal(sent, 10_000)
    t.equal(await drained(w.store), 0, 'every transaction ended')
    t.equal(await idleInTransaction(), 0, 'no connection is left idle in a transaction')
    if (CLIENT === 'postgres') {
      const probes = await Promise.all(Array.from({ length: 10 }, () => sql`SELECT 1 AS one`))
      t.equal(probes.length, 10, 'all 10 pooled connections are usable')
    } else {
      // node-postgres counts its clients: one never released would show here, and hold a slot.
      const pool = poolLike(sql)
      const counts = await settledCounts(pool)
      t.equal(counts.idle, counts.total, `every client is back in the pool (${JSON.stringify(counts)})`)
      t.ok(await everySlotFree(pool, 10), 'all 10 pooled clients can be checked out at once')
    }
    const completedRows = Number((await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.records WHERE state = 'completed'`)[0]?.n)
    const payRows = Number((await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.payments`)[0]?.n)
    t.equal(payRows, completedRows, 'every committed payment has its record, and every record its payment')
    t.equal(Number((await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.records WHERE state <> 'completed'`)[0]?.n), 0, 'no record stays in progress')
    t.ok((counts.get(201) ?? 0) > 0 && (counts.get(500) ?? 0) > 0, `a mix of outcomes: ${JSON.stringify([...counts])}`)
  })

  t.test('transaction: true needs a store that supports it', async (t) => {
    const app = Fastify()
    t.teardown(() => app.close())
    await t.rejects(async () => { await app.register(idempotency, { store: memoryStore(), transaction: true }) }, InvalidOptionError)
    const other = Fastify()
    t.teardown(() => other.close())
    await other.register(idempotency, { store: memoryStore(), scope: () => 's' })
    t.throws(() => other.post('/x', { config: { idempotency: { transaction: true } } }, async () => 'x'), /route POST \/x config\.idempotency\.transaction/)
  })

  t.test('the lease-mode and atomic-mode routes share one table', async (t) => {
    await reset()
    const store = postgresStore({ ...storeConnection(sql), schema, table: 'records', purgeInterval: 0 })
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'test' })
    app.post('/lease', async () => ({ mode: 'lease' }))
    app.post('/atomic', { config: { idempotency: { transaction: true } } }, async (request) => {
      t.ok(request.idempotency?.sql, 'the atomic route gets a transaction')
      return { mode: 'atomic' }
    })
    t.equal((await app.inject({ method: 'POST', url: '/lease', headers: keyed('m1'), payload: {} })).statusCode, 200)
    t.equal((await app.inject({ method: 'POST', url: '/atomic', headers: keyed('m2'), payload: {} })).statusCode, 200)
    t.same(await records('m1'), ['completed'])
    t.same(await records('m2'), ['completed'])
  })
}
