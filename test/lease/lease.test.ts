import { randomUUID } from 'node:crypto'
import type { FastifyInstance, LightMyRequestResponse } from 'fastify'
import t from 'tap'
import { canonicalFingerprint } from '../../lib/core/fingerprint.js'
import { memoryStore } from '../../lib/index.js'
import type { IdempotencyStore, Lease } from '../../lib/core/store.js'
import { buildApp, deferred, keyed, manualClock, PROBLEM_TYPE } from '../helpers/app.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Behaviour 10: an in-progress key whose owner stopped can be taken over after `lease`; a running
 * owner renews its lease so it is never taken over; completion is fenced by the owner's token.
 */

const BODY = { amount: 250, currency: 'EUR' }
const TTL = 24 * 60 * 60 * 1000

function pay (app: FastifyInstance, key: string): Promise<LightMyRequestResponse> {
  return app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: BODY })
}

/** The fingerprint the plugin computes for `POST /pay` with BODY (canonical mode). */
const fingerprint = canonicalFingerprint('POST', '/pay', BODY)

function completedBody (record: Awaited<ReturnType<IdempotencyStore['get']>>): string | null {
  return record?.state === 'completed' ? record.response.body?.toString() ?? null : null
}

t.test('a crashed owner\'s key is refused until its lease lapses, then taken over and executed', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0 })
  t.teardown(() => store.close())
  const LEASE = 5_000
  const app = await buildApp(t, { plugin: { store, lease: LEASE } })
  let executions = 0
  app.post('/pay', async (_request, reply) => {
    executions++
    reply.code(201)
    return { owner: 'new', execution: executions }
  })

  // The "crashed" owner: claimed the key exactly as the plugin would, then never completed.
  const crashed = await store.claim({ scope: 'test', key: 'crash-1', fingerprint, leaseMs: LEASE, ttlMs: TTL })
  if (crashed.outcome !== 'acquired') return t.fail('the simulated owner did not acquire the key')
  const oldLease: Lease = crashed.lease

  const early = await pay(app, 'crash-1')
  t.equal(early.statusCode, 409, 'right after the crash: 409')
  t.equal((JSON.parse(early.body) as { type: string }).type, PROBLEM_TYPE('request-in-progress'))

  clock.advance(LEASE - 1)
  t.equal((await pay(app, 'crash-1')).statusCode, 409, 'one millisecond before the lease lapses: still 409')
  t.equal(executions, 0, 'no execution while the lease holds')

  clock.advance(1)
  const takeover = await pay(app, 'crash-1')
  t.equal(takeover.statusCode, 201, 'after the lease: the request takes over and executes')
  t.equal(takeover.headers['idempotent-replayed'], undefined, 'an execution, not a replay')
  t.equal(executions, 1, 'the handler ran once')

  const late = await store.complete(oldLease, { statusCode: 200, headers: {}, body: Buffer.from('{"owner":"crashed"}') }, TTL)
  t.equal(late, false, 'the crashed owner\'s lease can no longer complete')
  t.equal(await store.release(oldLease), false, 'nor release')
  t.equal(await store.renew(oldLease, LEASE), false, 'nor renew')
  t.equal(completedBody(await store.get({ scope: 'test', key: 'crash-1' })), takeover.body, 'the record is the new owner\'s response')

  const retry = await pay(app, 'crash-1')
  t.equal(retry.statusCode, 201)
  t.equal(retry.headers['idempotent-replayed'], 'true')
  t.equal(retry.body, takeover.body, 'retries replay the new owner\'s response')
  t.equal(executions, 1)
})

t.test('a crashed owner\'s key with a different request is 422 even after its lease lapsed, never a takeover', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0 })
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store, lease: 1_000 } })
  let executions = 0
  app.post('/pay', async () => { executions++; return { ok: true } })

  const other = canonicalFingerprint('POST', '/pay', { amount: 1 })
  const crashed = await store.claim({ scope: 'test', key: 'crash-2', fingerprint: other, leaseMs: 1_000, ttlMs: TTL })
  t.equal(crashed.outcome, 'acquired')
  clock.advance(5_000)
  const res = await pay(app, 'crash-2')
  t.equal(res.statusCode, 422)
  t.equal((JSON.parse(res.body) as { type: string }).type, PROBLEM_TYPE('key-reused'))
  t.equal(executions, 0)
  t.equal((await store.get({ scope: 'test', key: 'crash-2' }))?.state, 'in_progress', 'the abandoned record is untouched')
})

t.test('a running owner renews its lease, so a slow handler is never taken over', async (t) => {
  const LEASE = 150
  const app = await buildApp(t, { plugin: { lease: LEASE } })
  let executions = 0
  app.post('/pay', async (_request, reply) => {
    executions++
    await sleep(600) // four times the lease
    reply.code(201)
    return { execution: executions }
  })

  const startedAt = Date.now()
  const original = pay(app, 'slow')
  await sleep(300 - (Date.now() - startedAt))
  const at300 = await pay(app, 'slow')
  await sleep(500 - (Date.now() - startedAt))
  const at500 = await pay(app, 'slow')

  t.equal(at300.statusCode, 409, 'a duplicate at 2 × lease gets 409')
  t.equal(at500.statusCode, 409, 'a duplicate at 3.3 × lease gets 409')
  t.equal(executions, 1, 'neither duplicate executed')

  const first = await original
  t.equal(first.statusCode, 201)
  t.equal(executions, 1, 'final count: 1')
  const retry = await pay(app, 'slow')
  t.equal(retry.headers['idempotent-replayed'], 'true', 'the slow owner recorded its response')
  t.equal(retry.body, first.body)
})

t.test('a zombie owner cannot overwrite the record of the attempt that took its key over', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0 })
  t.teardown(() => store.close())
  // A long lease on a manual clock: renewals (every lease / 3 of real time) never fire during the
  // test, so the lease lapses exactly when the test moves the clock.
  const LEASE = 30_000
  const app = await buildApp(t, { plugin: { store, lease: LEASE } })
  let executions = 0
  const aStarted = deferred()
  const aGate = deferred()
  app.post('/pay', async (_request, reply) => {
    const execution = ++executions
    if (execution === 1) {
      aStarted.resolve()
      await aGate.promise
    }
    reply.code(201)
    return { owner: execution === 1 ? 'A' : 'B', charge: randomUUID() }
  })

  const a = pay(app, 'zombie')
  await aStarted.promise
  clock.advance(LEASE) // A stalls past its lease (a GC pause, a partition)

  const b = await pay(app, 'zombie')
  t.equal(b.statusCode, 201, 'B took the lapsed key over and executed')
  t.match(JSON.parse(b.body), { owner: 'B' })
  t.equal(executions, 2)
  t.equal(completedBody(await store.get({ scope: 'test', key: 'zombie' })), b.body, 'the record is B\'s')

  aGate.resolve()
  const aRes = await a
  t.equal(aRes.statusCode, 201, 'A\'s client still gets A\'s response (its effect happened)')
  t.match(JSON.parse(aRes.body), { owner: 'A' })
  t.equal(aRes.headers['idempotent-replayed'], undefined)
  t.equal(completedBody(await store.get({ scope: 'test', key: 'zombie' })), b.body, 'the record stays B\'s after A finished')

  const retry = await pay(app, 'zombie')
  t.equal(retry.headers['idempotent-replayed'], 'true')
  t.equal(retry.body, b.body, 'later retries replay B\'s response')
  t.equal(executions, 2)
})

t.test('a zombie owner whose renewals report the lease lost is fenced the same way', async (t) => {
  // Real clock: the store wrapper pauses renewals (they report ownership lost), so A's short lease
  // really lapses while A's handler is held.
  const base = memoryStore({ purgeInterval: 0 })
  t.teardown(() => base.close())
  let renewals = 0
  const store: IdempotencyStore = { ...base, renew: async () => { renewals++; return false } }
  const LEASE = 60
  const app = await buildApp(t, { plugin: { store, lease: LEASE } })
  let executions = 0
  const aStarted = deferred()
  const aGate = deferred()
  app.post('/pay', async (_request, reply) => {
    const execution = ++executions
    if (execution === 1) {
      aStarted.resolve()
      await aGate.promise
    }
    reply.code(201)
    return { owner: execution === 1 ? 'A' : 'B' }
  })

  const a = pay(app, 'zombie-2')
  await aStarted.promise
  await sleep(LEASE * 3)
  t.ok(renewals >= 1, 'A tried to renew')
  const b = await pay(app, 'zombie-2')
  t.equal(b.statusCode, 201, 'B took over')
  aGate.resolve()
  const aRes = await a
  t.match(JSON.parse(aRes.body), { owner: 'A' }, 'A answers its own client')
  t.equal(completedBody(await base.get({ scope: 'test', key: 'zombie-2' })), b.body, 'the record is B\'s')
  const retry = await pay(app, 'zombie-2')
  t.equal(retry.body, b.body)
  t.equal(retry.headers['idempotent-replayed'], 'true')
  t.equal(executions, 2)
})
