import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type ClaimRequest, type ClaimResult, type IdempotencyStore } from '../../lib/index.js'
import { gatedHandler } from '../helpers/gated-handler.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Duplicates that wait (the `wait` option) share their store calls within one process: a claim or
 * read of a key another waiting duplicate has in flight is joined, not sent again
 * (lib/core/shared-calls.ts). What must hold: a storm costs the store a call per key at a time, not
 * one per duplicate; a joined claim that acquired the key runs once, as its asker's; a call the
 * store never answers is joined only until its asker's storeTimeout; an answer that could not read
 * the record in the way (`unseen`) carries no other request's fingerprint.
 */

interface World {
  readonly app: FastifyInstance
  readonly runs: () => number
  /** Claims that reached the store. */
  readonly claims: () => number
  /** Lets the handler in flight answer, or fail (the key is released). */
  readonly finish: (fail?: boolean) => void
}

/** A memory store whose claims take `claimMs`, with settlement notices, behind `store` when given (to change what it answers). */
async function world (t: Test, options: { wait: number, storeTimeout?: number, claimMs?: number, store?: (inner: IdempotencyStore) => IdempotencyStore }): Promise<World> {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  let claims = 0
  const delayed: IdempotencyStore = {
    ...inner,
    claim: async (request: ClaimRequest): Promise<ClaimResult> => {
      claims++
      await sleep(options.claimMs ?? 20)
      return await inner.claim(request)
    },
    // Notices flow (as from the PostgreSQL store): waiters sleep until a settlement wakes them
    // instead of polling. The settlements here are this process's own, which wake them anyway.
    watchSettlements: ({ live }) => {
      live(true)
      return () => {}
    }
  }
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store: options.store?.(delayed) ?? delayed, scope: () => 'acct', wait: options.wait, ...(options.storeTimeout === undefined ? {} : { storeTimeout: options.storeTimeout }) })
  const gated = gatedHandler()
  app.post('/pay', gated.handler)
  await app.ready()
  return { app, runs: gated.runs, claims: () => claims, finish: gated.finish }
}

const pay = (app: FastifyInstance, body: object = { amount: 1 }) =>
  app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': '"k"' }, payload: body })

async function until (condition: () => boolean): Promise<void> {
  for (let i = 0; i < 400 && !condition(); i++) await sleep(5)
}

t.test('20 duplicates waiting together cost the store a claim when they arrive and one when the original settles, not one each', async (t) => {
  const w = await world(t, { wait: 5_000, claimMs: 100 })
  const original = pay(w.app)
  await until(() => w.runs() === 1)
  const duplicates = Array.from({ length: 20 }, () => pay(w.app))
  await sleep(300)
  // One claim for those that arrive while it is in flight; a slow machine may spread the 20
  // over two.
  const arriving = w.claims() - 1
  t.ok(arriving >= 1 && arriving <= 2, `${arriving} claim(s) for the 20 duplicates as they arrived`)
  w.finish()
  t.equal((await original).statusCode, 200)
  const answers = await Promise.all(duplicates)
  t.same(answers.map((answer) => answer.statusCode), Array(20).fill(200))
  t.ok(answers.every((answer) => answer.headers['idempotent-replayed'] === 'true'), 'every duplicate replays')
  t.equal(w.runs(), 1)
  t.equal(w.claims() - 1 - arriving, 1, 'one claim, shared, once woken')
})

t.test('a released original: the shared claim that acquires the key runs it once; those that joined it wait for that run', async (t) => {
  const w = await world(t, { wait: 5_000 })
  const original = pay(w.app)
  await until(() => w.runs() === 1)
  const duplicates = Array.from({ length: 10 }, () => pay(w.app))
  await sleep(100)
  w.finish(true)
  t.equal((await original).statusCode, 500)
  await until(() => w.runs() === 2)
  await sleep(50)
  t.equal(w.runs(), 2, 'one waiter runs the operation, and only one')
  w.finish()
  const answers = await Promise.all(duplicates)
  t.same(answers.map((answer) => answer.statusCode), Array(10).fill(200))
  t.equal(answers.filter((answer) => answer.headers['idempotent-replayed'] !== 'true').length, 1, 'one fresh answer, nine replays of it')
  t.equal(new Set(answers.map((answer) => answer.body)).size, 1)
})

t.test('a claim the store never answers is joined only until its storeTimeout: a later duplicate asks for itself', async (t) => {
  let hang = false
  const w = await world(t, {
    wait: 5_000,
    storeTimeout: 100,
    store: (inner) => ({
      ...inner,
      claim: (request) => hang ? new Promise<never>(() => {}) : inner.claim(request)
    })
  })
  const original = pay(w.app)
  await until(() => w.runs() === 1)
  hang = true
  const lost = await pay(w.app)
  t.equal(lost.statusCode, 503, 'its claim went unanswered past storeTimeout')
  hang = false
  const later = pay(w.app)
  await sleep(50)
  w.finish()
  t.equal((await original).statusCode, 200)
  const answer = await later
  t.equal(answer.statusCode, 200, 'answered by a claim of its own, not by joining the unanswered one')
  t.equal(answer.headers['idempotent-replayed'], 'true')
})

t.test('an answer that could not read the record in the way is shared without the asker\'s fingerprint: a different request waits, it is not refused 422', async (t) => {
  const w = await world(t, {
    wait: 200,
    store: (inner) => ({
      ...inner,
      // As the PostgreSQL store answers a duplicate of an uncommitted atomic claim.
      claim: async (request) => {
        await sleep(20)
        return { outcome: 'in_progress', fingerprint: request.fingerprint, leaseRemainingMs: 0, unseen: true }
      }
    })
  })
  const [first, different] = await Promise.all([pay(w.app, { amount: 1 }), pay(w.app, { amount: 2 })])
  t.equal(first.statusCode, 409)
  t.equal(different.statusCode, 409, 'in progress for both: the record\'s fingerprint is unknown')
})
