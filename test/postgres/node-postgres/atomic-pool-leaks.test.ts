import http from 'node:http'
import type { AddressInfo } from 'node:net'
import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { type IdempotencyOptions } from '../../../lib/index.js'
import type { PostgresStore } from '../../../drivers/postgres/index.js'
import { everySlotFree, settledCounts } from '../../helpers/pool-accounting.js'
import { deferred, drained, keyed, nodePostgresWorld, poolClientOf } from '../../helpers/node-postgres-world.js'
import { sleep } from '../../helpers/sleep.js'

/**
 * node-postgres, atomic mode: every transaction checks a client out of the pool for its whole
 * life, so every way a request ends must give it back, once. After each kind of ending, checked
 * on its own: no open transaction (`openTransactions`), every client idle (`totalCount` =
 * `idleCount`, nobody waiting), all `max` clients can be checked out at once, and no backend of
 * the pool is left idle inside a transaction.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/node-postgres/atomic-pool-leaks.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

interface Body { amount: number, fail?: 'throw' | '500' | 'hold', ref?: string }

function suite (url: string): void {
  // A small pool: a single leaked client is a quarter of it.
  const db = nodePostgresWorld(t, url, 4)
  let tables = 0

  /** POST /pay writes a payment through the PoolClient; `fail` makes it throw, answer 500, or wait for `release`. */
  async function world (t: Test, options: IdempotencyOptions = {}): Promise<{ app: FastifyInstance, store: PostgresStore, runs: () => number, entered: (key: string) => Promise<void>, release: () => void }> {
    const store = await db.store(`records_${++tables}`)
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'test', transaction: true, ...options })
    let runs = 0
    const entries = new Map<string, ReturnType<typeof deferred>>()
    const entered = (key: string): ReturnType<typeof deferred> => {
      const entry = entries.get(key) ?? deferred()
      entries.set(key, entry)
      return entry
    }
    const held = deferred()
    app.post<{ Body: Body }>('/pay', async (request, reply) => {
      runs++
      const key = request.idempotency?.key ?? ''
      await poolClientOf(request).query(`INSERT INTO ${db.payTable} (key, amount, ref) VALUES ($1, $2, $3)`, [key, request.body.amount, request.body.ref ?? null])
      if (request.body.fail === 'hold') {
        entered(key).resolve()
        await held.promise
      }
      if (request.body.fail === 'throw') throw new Error('the card network exploded')
      if (request.body.fail === '500') return reply.code(500).send({ error: 'oops' })
      return reply.code(201).send({ key, amount: request.body.amount })
    })
    return { app, store, runs: () => runs, entered: async (key) => await entered(key).promise, release: held.resolve }
  }

  const pay = (app: FastifyInstance, key: string, body: Body) => app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: body })

  /** Nothing of the transactions is left: the checks after each kind of ending. */
  async function nothingLeaked (t: Test, store: PostgresStore): Promise<void> {
    t.equal(await drained(store), 0, 'openTransactions is back to 0')
    const counts = await settledCounts(db.pool)
    t.ok(counts.total > 0, `the pool was used (${JSON.stringify(counts)})`)
    t.equal(counts.idle, counts.total, `every client is back in the pool (${JSON.stringify(counts)})`)
    t.equal(counts.waiting, 0, 'nobody waits for a client')
    t.ok(await everySlotFree(db.pool, db.max), `all ${db.max} clients can be checked out at once`)
    t.equal(await db.idleInTransaction(), 0, 'no backend is left idle inside a transaction')
  }

  t.test('commits (and their replays)', async (t) => {
    const w = await world(t)
    const answers = await Promise.all(Array.from({ length: 12 }, (_, i) => pay(w.app, `c-${i}`, { amount: 1 })))
    t.same(answers.map((a) => a.statusCode), Array(12).fill(201))
    const replays = await Promise.all(Array.from({ length: 12 }, (_, i) => pay(w.app, `c-${i}`, { amount: 1 })))
    t.equal(replays.filter((a) => a.headers['idempotent-replayed'] === 'true').length, 12)
    t.equal(w.runs(), 12)
    t.equal(await db.payments('c-0'), 1)
    await nothingLeaked(t, w.store)
  })

  t.test('rollbacks: a 5xx answer, a handler that throws, a COMMIT that fails', async (t) => {
    const w = await world(t)
    await db.admin`INSERT INTO ${db.admin(db.schema)}.payments (key, amount, ref) VALUES ('other', 1, 'taken')`
    const answers = await Promise.all(Array.from({ length: 12 }, (_, i) => {
      const body: Body = i % 3 === 0 ? { amount: 1, fail: '500' } : i % 3 === 1 ? { amount: 1, fail: 'throw' } : { amount: 1, ref: 'taken' }
      return pay(w.app, `r-${i}`, body)
    }))
    t.same(answers.map((a) => a.statusCode), Array(12).fill(500))
    t.equal(answers.filter((a) => a.json().type === 'tag:fastify-idempotency,2026:not-committed').length, 4, 'the failed COMMITs')
    for (let i = 0; i < 12; i++) t.equal(await db.payments(`r-${i}`), 0, `r-${i} rolled back`)
    await nothingLeaked(t, w.store)
  })

  t.test('409s: a duplicate of an uncommitted claim, at once (no wait) and after waiting for it', async (t) => {
    const w = await world(t)
    const original = pay(w.app, 'busy', { amount: 1, fail: 'hold' })
    await w.entered('busy')
    const atOnce = await Promise.all(Array.from({ length: 6 }, () => pay(w.app, 'busy', { amount: 1 })))
    t.same(atOnce.map((a) => a.statusCode), Array(6).fill(409))
    // Waiting up to `wait` for the original, outside any transaction (no connection held), then 409.
    const waiting = Fastify()
    t.teardown(() => waiting.close())
    await waiting.register(idempotency, { store: w.store, scope: () => 'test', transaction: true, wait: 100 })
    waiting.post('/pay', async () => ({ never: true }))
    const afterWaiting = await Promise.all(Array.from({ length: 2 }, () => waiting.inject({ method: 'POST', url: '/pay', headers: keyed('busy'), payload: { amount: 1 } })))
    t.same(afterWaiting.map((a) => a.statusCode), [409, 409])
    w.release()
    t.equal((await original).statusCode, 201)
    t.equal(w.runs(), 1)
    await nothingLeaked(t, w.store)
  })

  t.test('422s: the same key with a different request, after the commit', async (t) => {
    const w = await world(t)
    t.equal((await pay(w.app, 'mismatch', { amount: 1 })).statusCode, 201)
    const answers = await Promise.all(Array.from({ length: 8 }, (_, i) => pay(w.app, 'mismatch', { amount: 2 + i })))
    t.same(answers.map((a) => a.statusCode), Array(8).fill(422))
    t.equal(w.runs(), 1)
    await nothingLeaked(t, w.store)
  })

  /** A request on a real socket, to be destroyed: resolves once it is gone. */
  async function listening (w: { app: FastifyInstance }): Promise<(key: string, body: Body, leave: Promise<void>) => Promise<void>> {
    await w.app.listen({ host: '127.0.0.1', port: 0 })
    const port = (w.app.server.address() as AddressInfo).port
    return async (key, body, leave) => await new Promise((resolve) => {
      const request = http.request({ host: '127.0.0.1', port, method: 'POST', path: '/pay', headers: keyed(key), agent: false })
      request.on('error', () => resolve())
      request.on('close', () => resolve())
      request.on('response', (response) => { response.resume() })
      request.end(JSON.stringify(body))
      void leave.then(() => request.destroy())
    })
  }

  t.test('clients that go away mid-handler: each transaction rolls back at once', async (t) => {
    const w = await world(t)
    const send = await listening(w)
    const keys = ['gone-0', 'gone-1', 'gone-2']
    await Promise.all(keys.map((key) => send(key, { amount: 1, fail: 'hold' }, w.entered(key).then(() => sleep(20)))))
    t.equal(await drained(w.store), 0, 'rolled back while the handlers still wait')
    t.equal(await db.idleInTransaction(), 0)
    w.release()
    await sleep(50)
    for (const key of keys) t.equal(await db.payments(key), 0, `${key} rolled back`)
    await nothingLeaked(t, w.store)
  })

  t.test('clients that go away while their claim waits for a pool client', async (t) => {
    const w = await world(t)
    const send = await listening(w)
    // The pool's 4 clients, each held by a handler.
    const holders = Array.from({ length: db.max }, (_, i) => `holder-${i}`)
    const holding = holders.map((key) => send(key, { amount: 1, fail: 'hold' }, new Promise(() => {})))
    await Promise.all(holders.map((key) => w.entered(key)))
    const queued = ['queued-0', 'queued-1', 'queued-2']
    const leave = deferred()
    const leaving = queued.map((key) => send(key, { amount: 1, fail: 'hold' }, leave.promise))
    for (let i = 0; i < 300 && db.pool.waitingCount < queued.length; i++) await sleep(10)
    t.equal(db.pool.waitingCount, queued.length, 'their claims wait for a client')
    leave.resolve()
    await Promise.all(leaving)
    w.release()
    await Promise.all(holding)
    for (let i = 0; i < 300 && w.runs() < holders.length; i++) await sleep(10)
    await drained(w.store)
    // The client left before its claim landed: lib/fastify/claim.ts (becomeOwner) rolls the transaction
    // back as soon as the claim lands, as for a client that leaves while the handler runs, so
    // nothing commits and the key is free for the retry.
    for (const key of queued) {
      t.same(await db.records(`records_${tables}`, key), [], `${key}: rolled back, no record left`)
      t.equal(await db.payments(key), 0, `${key}: and no payment`)
    }
    await nothingLeaked(t, w.store)
  })
}
