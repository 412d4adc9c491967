import { randomUUID } from 'node:crypto'
import type { AddressInfo } from 'node:net'
import type { FastifyInstance, LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import { memoryStore } from '../../lib/index.js'
import type { IdempotencyStore } from '../../lib/core/store.js'
import { buildApp, deferred, keyed, PROBLEM_TYPE } from '../helpers/app.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Behaviour 6 (and the "at most one execution" core of 3/4): duplicates of an in-flight original
 * never execute; they get 409 (or, with `wait`, the original's replay).
 */

const BODY = { amount: 100, currency: 'EUR' }

interface Gate {
  /** Resolved when the handler has started its first execution. */
  readonly started: Promise<void>
  /** Lets held executions finish. */
  readonly open: () => void
  /** How many times the handler ran. */
  readonly count: () => number
}

/**
 * A POST /pay route whose executions are held until the gate opens. Each execution answers 201
 * with a body unique to it, so identical bodies prove a single execution.
 */
function payRoute (app: FastifyInstance, options: { fail?: (execution: number) => boolean } = {}): Gate {
  let executions = 0
  const started = deferred()
  const gate = deferred()
  app.post('/pay', async (request, reply) => {
    const execution = ++executions
    started.resolve()
    await gate.promise
    if (options.fail?.(execution) === true) throw new Error(`execution ${execution} failed`)
    reply.code(201)
    return { execution, charge: randomUUID(), key: request.idempotency?.key ?? null }
  })
  return { started: started.promise, open: () => gate.resolve(), count: () => executions }
}

function pay (app: FastifyInstance, key: string, body: unknown = BODY): Promise<LightMyRequestResponse> {
  return app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: body as Record<string, unknown> })
}

/** Tracks how many of a set of promises have settled, so a test can wait for the refusals deterministically. */
function settledCounter<T> (promises: Array<Promise<T>>): { settled: () => number } {
  let settled = 0
  for (const p of promises) p.then(() => { settled++ }, () => { settled++ })
  return { settled: () => settled }
}

/** Waits (bounded) until `predicate` holds; fails the test instead of hanging. */
async function until (t: Test, predicate: () => boolean, what: string, limitMs = 3000): Promise<void> {
  const deadline = Date.now() + limitMs
  while (!predicate()) {
    if (Date.now() > deadline) {
      t.fail(`timed out waiting for ${what}`)
      return
    }
    await sleep(5)
  }
}

function assertInProgressProblem (t: Test, res: { statusCode: number, headers: Record<string, unknown>, body: string }, label: string): void {
  t.equal(res.statusCode, 409, `${label}: 409`)
  t.match(String(res.headers['content-type']), /^application\/problem\+json/, `${label}: problem+json`)
  t.equal(res.headers['retry-after'], '1', `${label}: Retry-After: 1`)
  t.equal(res.headers['idempotent-replayed'], undefined, `${label}: not a replay`)
  const problem = JSON.parse(res.body) as Record<string, unknown>
  t.equal(problem.type, PROBLEM_TYPE('request-in-progress'), `${label}: problem type`)
  t.equal(problem.status, 409, `${label}: problem status`)
}

t.test('a duplicate of an in-flight original gets 409 request-in-progress with Retry-After, and never runs', async (t) => {
  const app = await buildApp(t)
  const gate = payRoute(app)

  const original = pay(app, 'dup-1')
  await gate.started
  const duplicate = await pay(app, 'dup-1')
  assertInProgressProblem(t, duplicate, 'duplicate')
  t.equal(gate.count(), 1, 'the handler ran once')

  gate.open()
  const first = await original
  t.equal(first.statusCode, 201, 'the original completes normally')
  t.equal(first.headers['idempotent-replayed'], undefined, 'the original is not marked replayed')
  t.equal(gate.count(), 1)
})

t.test('once the original completes, the same request replays its 201 (not 409, not 422)', async (t) => {
  const app = await buildApp(t)
  const gate = payRoute(app)

  const original = pay(app, 'dup-2')
  await gate.started
  t.equal((await pay(app, 'dup-2')).statusCode, 409, 'while in flight: 409')
  gate.open()
  const first = await original

  const retry = await pay(app, 'dup-2')
  t.equal(retry.statusCode, 201, 'the retry gets the recorded status')
  t.equal(retry.headers['idempotent-replayed'], 'true')
  t.equal(retry.body, first.body, 'byte-identical body')
  t.equal(gate.count(), 1, 'the 409 left no trace: the handler still ran once')
})

t.test('10 simultaneous requests with one key and body: exactly one execution, the 9 others 409', async (t) => {
  const app = await buildApp(t)
  const gate = payRoute(app)

  const all = Array.from({ length: 10 }, () => pay(app, 'storm'))
  const progress = settledCounter(all)
  await gate.started
  // The original is held in its handler until every duplicate has been answered.
  await until(t, () => progress.settled() === 9, '9 duplicates to be answered')
  gate.open()
  const responses = await Promise.all(all)

  t.equal(gate.count(), 1, 'the handler ran exactly once')
  const created = responses.filter((r) => r.statusCode === 201)
  const refused = responses.filter((r) => r.statusCode === 409)
  t.equal(created.length, 1, 'one 201')
  t.equal(refused.length, 9, 'nine 409')
  for (const r of refused) assertInProgressProblem(t, r, 'duplicate')

  // Every later retry gets the same bytes as the one execution.
  const retries = await Promise.all(Array.from({ length: 10 }, () => pay(app, 'storm')))
  for (const r of retries) {
    t.equal(r.statusCode, 201)
    t.equal(r.body, created[0]?.body, 'every 2xx body is identical')
  }
  t.equal(gate.count(), 1)
})

t.test('10 simultaneous requests released at once: one execution, every 2xx body identical', async (t) => {
  const app = await buildApp(t)
  const gate = payRoute(app)
  gate.open() // nothing held: the requests race freely through claim, handler and record

  const responses = await Promise.all(Array.from({ length: 10 }, () => pay(app, 'race')))
  t.equal(gate.count(), 1, 'the handler ran exactly once')
  const ok = responses.filter((r) => r.statusCode >= 200 && r.statusCode < 300)
  const other = responses.filter((r) => r.statusCode < 200 || r.statusCode >= 300)
  t.ok(ok.length >= 1, 'at least the original succeeded')
  for (const r of other) t.equal(r.statusCode, 409, 'every non-2xx is a 409')
  const bodies = new Set(ok.map((r) => r.body))
  t.equal(bodies.size, 1, 'all 2xx bodies are byte-identical')
  t.equal(ok.filter((r) => r.headers['idempotent-replayed'] === undefined).length, 1, 'exactly one 2xx is the original')
})

t.test('over real HTTP, 50 concurrent fetches with one key: one execution, 49 refused', async (t) => {
  const app = await buildApp(t)
  const gate = payRoute(app)
  await app.listen({ host: '127.0.0.1', port: 0 })
  const { port } = app.server.address() as AddressInfo
  const url = `http://127.0.0.1:${port}/pay`

  const all = Array.from({ length: 50 }, async () => {
    const res = await fetch(url, { method: 'POST', headers: keyed('http-storm'), body: JSON.stringify(BODY) })
    return { statusCode: res.status, headers: Object.fromEntries(res.headers), body: await res.text() }
  })
  const progress = settledCounter(all)
  await gate.started
  await until(t, () => progress.settled() === 49, '49 duplicates to be answered', 5000)
  gate.open()
  const responses = await Promise.all(all)

  t.equal(gate.count(), 1, 'the handler ran exactly once')
  t.equal(responses.filter((r) => r.statusCode === 201).length, 1, 'one 201')
  const refused = responses.filter((r) => r.statusCode === 409)
  t.equal(refused.length, 49, '49 × 409')
  t.ok(refused.every((r) => r.headers['retry-after'] === '1'), 'every 409 has Retry-After: 1')
  t.ok(refused.every((r) => (JSON.parse(r.body) as { type?: string }).type === PROBLEM_TYPE('request-in-progress')), 'every 409 is request-in-progress')
})

t.test('over real HTTP with wait, 50 concurrent fetches all get the one execution\'s 201', async (t) => {
  const app = await buildApp(t, { plugin: { wait: 2000 } })
  let arrived = 0
  app.addHook('onRequest', async () => { arrived++ })
  const gate = payRoute(app)
  await app.listen({ host: '127.0.0.1', port: 0 })
  const { port } = app.server.address() as AddressInfo
  const url = `http://127.0.0.1:${port}/pay`

  const all = Array.from({ length: 50 }, async () => {
    const res = await fetch(url, { method: 'POST', headers: keyed('http-wait'), body: JSON.stringify(BODY) })
    return { statusCode: res.status, replayed: res.headers.get('idempotent-replayed'), body: await res.text() }
  })
  await gate.started
  await until(t, () => arrived === 50, 'all 50 requests to reach the server', 5000)
  gate.open()
  const responses = await Promise.all(all)

  t.equal(gate.count(), 1, 'the handler ran exactly once')
  t.ok(responses.every((r) => r.statusCode === 201), 'all 50 got 201')
  t.equal(new Set(responses.map((r) => r.body)).size, 1, 'all 50 bodies are byte-identical')
  t.equal(responses.filter((r) => r.replayed === 'true').length, 49, '49 replays, 1 original')
})

t.test('5 keys × 10 concurrent requests each: exactly 5 executions, one per key', async (t) => {
  const app = await buildApp(t)
  const gate = payRoute(app)
  const keys = ['k-a', 'k-b', 'k-c', 'k-d', 'k-e']

  const all = keys.flatMap((key) => Array.from({ length: 10 }, () => pay(app, key).then((res) => ({ key, res }))))
  const progress = settledCounter(all)
  await until(t, () => gate.count() === 5 && progress.settled() === 45, 'five originals in flight and 45 duplicates answered')
  gate.open()
  const results = await Promise.all(all)

  t.equal(gate.count(), 5, 'the handler ran exactly 5 times')
  for (const key of keys) {
    const mine = results.filter((r) => r.key === key)
    t.equal(mine.filter((r) => r.res.statusCode === 201).length, 1, `${key}: one 201`)
    t.equal(mine.filter((r) => r.res.statusCode === 409).length, 9, `${key}: nine 409`)
    const created = mine.find((r) => r.res.statusCode === 201)
    t.equal((JSON.parse(created?.res.body ?? '{}') as { key?: string }).key, key, `${key}: its own execution answered it`)
  }
  const executions = new Set(results.filter((r) => r.res.statusCode === 201).map((r) => (JSON.parse(r.res.body) as { execution: number }).execution))
  t.equal(executions.size, 5, 'five distinct executions')
})

t.test('with wait, a duplicate waits for the in-flight original and gets its replay', async (t) => {
  const app = await buildApp(t, { plugin: { wait: 2000 } })
  const gate = payRoute(app)

  const original = pay(app, 'wait-1')
  await gate.started
  let answered = false
  const duplicate = pay(app, 'wait-1').then((res) => { answered = true; return { res, at: Date.now() } })
  await sleep(100)
  t.equal(answered, false, 'the duplicate is still waiting while the original runs')

  const openedAt = Date.now()
  gate.open()
  const first = await original
  const { res, at } = await duplicate

  t.equal(res.statusCode, 201, 'the duplicate gets the original status')
  t.equal(res.headers['idempotent-replayed'], 'true', 'as a replay')
  t.equal(res.body, first.body, 'with the original body')
  t.equal(first.headers['idempotent-replayed'], undefined)
  t.equal(gate.count(), 1, 'the handler ran once')
  // Sanity bound only: the in-process notification wakes the waiter, it does not sit out `wait`.
  t.ok(at - openedAt < 1000, `woken when the original finished (${at - openedAt} ms after, wait is 2000 ms)`)
})

t.test('with a wait shorter than the original, the duplicate gets 409 after waiting', async (t) => {
  const app = await buildApp(t, { plugin: { wait: 100 } })
  let executions = 0
  app.post('/pay', async (_request, reply) => {
    executions++
    await sleep(400)
    reply.code(201)
    return { execution: executions }
  })

  const original = pay(app, 'wait-short')
  await sleep(20)
  const sentAt = Date.now()
  const duplicate = await pay(app, 'wait-short')
  const waited = Date.now() - sentAt
  assertInProgressProblem(t, duplicate, 'duplicate after its wait')
  t.ok(waited >= 90, `the duplicate waited about \`wait\` before the 409 (${waited} ms)`)

  const first = await original
  t.equal(first.statusCode, 201)
  t.equal(executions, 1, 'the duplicate never executed')
})

t.test('with wait, when the original fails the waiting duplicate claims the key and executes itself', async (t) => {
  const app = await buildApp(t, { plugin: { wait: 2000 } })
  const gate = payRoute(app, { fail: (execution) => execution === 1 })

  const original = pay(app, 'wait-fail')
  await gate.started
  const duplicate = pay(app, 'wait-fail')
  await sleep(50)
  gate.open()

  const failed = await original
  t.equal(failed.statusCode, 500, 'the original failed')
  const res = await duplicate
  t.equal(res.statusCode, 201, 'the duplicate executed and succeeded')
  t.equal(res.headers['idempotent-replayed'], undefined, 'it is an execution, not a replay')
  t.equal(gate.count(), 2, 'the handler ran twice: the failed original and the duplicate')
  t.equal((JSON.parse(res.body) as { execution: number }).execution, 2)

  const retry = await pay(app, 'wait-fail')
  t.equal(retry.headers['idempotent-replayed'], 'true', 'the duplicate\'s outcome is now the record')
  t.equal(retry.body, res.body)
})

t.test('a waiter whose original runs in another process replays by polling the shared store', async (t) => {
  const shared: IdempotencyStore = memoryStore({ purgeInterval: 0 })
  t.teardown(() => shared.close())
  let claimsByB = 0
  // Instance B sees the same records but gets no in-process notification from A.
  const storeB: IdempotencyStore = { ...shared, claim: (request) => { claimsByB++; return shared.claim(request) } }

  const appA = await buildApp(t, { plugin: { store: shared } })
  const appB = await buildApp(t, { plugin: { store: storeB, wait: 2000 } })
  let executions = 0
  const started = deferred()
  const gate = deferred()
  for (const app of [appA, appB]) {
    app.post('/pay', async (_request, reply) => {
      const execution = ++executions
      started.resolve()
      await gate.promise
      reply.code(201)
      return { execution, charge: randomUUID() }
    })
  }

  const original = pay(appA, 'cross')
  await started.promise
  let answered = false
  const duplicate = pay(appB, 'cross').then((res) => { answered = true; return res })
  await sleep(100)
  t.equal(answered, false, 'B is waiting on A\'s original')
  gate.resolve()

  const first = await original
  const res = await duplicate
  t.equal(first.statusCode, 201)
  t.equal(res.statusCode, 201, 'B replays A\'s outcome')
  t.equal(res.headers['idempotent-replayed'], 'true')
  t.equal(res.body, first.body, 'with A\'s body')
  t.equal(executions, 1, 'one execution across both instances')
  t.ok(claimsByB >= 2, `B polled the store (${claimsByB} claims)`)
})

t.test('a waiter polling another process\'s original still ends in 409 when that original outlasts wait', async (t) => {
  const shared: IdempotencyStore = memoryStore({ purgeInterval: 0 })
  t.teardown(() => shared.close())
  const appA = await buildApp(t, { plugin: { store: shared } })
  const appB = await buildApp(t, { plugin: { store: shared, wait: 150 } })
  let executions = 0
  const started = deferred()
  const gate = deferred()
  for (const app of [appA, appB]) {
    app.post('/pay', async (_request, reply) => {
      executions++
      started.resolve()
      await gate.promise
      reply.code(201)
      return { ok: true }
    })
  }

  const original = pay(appA, 'cross-409')
  await started.promise
  const res = await pay(appB, 'cross-409')
  assertInProgressProblem(t, res, 'B after its wait')
  gate.resolve()
  t.equal((await original).statusCode, 201)
  t.equal(executions, 1)
})
