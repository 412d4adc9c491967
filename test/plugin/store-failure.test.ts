import type { FastifyInstance, LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import { memoryStore } from '../../lib/index.js'
import type { IdempotencyStore } from '../../lib/core/store.js'
import { buildApp, keyed, PROBLEM_TYPE } from '../helpers/app.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Behaviour 13: a store that throws or hangs is a 503 problem by default, never a silent
 * unprotected run; `onStoreError: 'bypass'` runs the handler unprotected and logs it every time.
 * Failures after the handler ran never hide its real response from the client.
 */

const BODY = { amount: 5 }

function post (app: FastifyInstance, key: string): Promise<LightMyRequestResponse> {
  return app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: BODY })
}

/** A memory store with one method replaced. */
function storeWith (override: Partial<IdempotencyStore>): { store: IdempotencyStore, base: IdempotencyStore } {
  const base = memoryStore({ purgeInterval: 0 })
  return { base, store: { ...base, ...override } }
}

interface LogLine { level: number, msg: string, idempotency?: { outcome?: string }, err?: { message?: string } }

/** A pino destination keeping every line written. */
function logCapture (): { stream: { write: (line: string) => void }, lines: LogLine[] } {
  const lines: LogLine[] = []
  return { lines, stream: { write: (line: string) => { lines.push(JSON.parse(line) as LogLine) } } }
}

const storeErrors = (lines: LogLine[]): LogLine[] =>
  lines.filter((line) => line.level === 50 && line.idempotency?.outcome === 'store_error')

function payRoute (app: FastifyInstance): () => number {
  let executions = 0
  app.post('/pay', async (request, reply) => {
    executions++
    reply.code(201)
    return { execution: executions, protected: request.idempotency !== null }
  })
  return () => executions
}

function assertUnavailable (t: Test, res: LightMyRequestResponse): void {
  t.equal(res.statusCode, 503)
  t.match(String(res.headers['content-type']), /^application\/problem\+json/)
  t.equal(res.headers['retry-after'], '1', 'Retry-After is set')
  const problem = JSON.parse(res.body) as Record<string, unknown>
  t.equal(problem.type, PROBLEM_TYPE('store-unavailable'))
  t.equal(problem.status, 503)
  t.notMatch(res.body, /connection refused|at .*\.(ts|js):\d+/, 'the store\'s error and stack are not exposed')
}

t.test('a claim that rejects answers 503 store-unavailable and the handler does not run', async (t) => {
  const { store } = storeWith({ claim: async () => { throw new Error('connection refused') } })
  t.teardown(() => store.close())
  const log = logCapture()
  const app = await buildApp(t, { plugin: { store }, fastify: { logger: { level: 'error', stream: log.stream } } })
  const count = payRoute(app)

  const res = await post(app, 'down')
  assertUnavailable(t, res)
  t.equal(count(), 0, 'never a silent unprotected run')
  t.equal(storeErrors(log.lines).length, 1, 'the failure is logged')
  t.equal(storeErrors(log.lines)[0]?.err?.message, 'connection refused', 'with the store\'s error')
})

t.test('a claim that never resolves answers 503 after storeTimeout', async (t) => {
  const { store } = storeWith({ claim: () => new Promise(() => {}) })
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store, storeTimeout: 100 } })
  const count = payRoute(app)

  const sentAt = Date.now()
  const res = await post(app, 'hangs')
  const waited = Date.now() - sentAt
  assertUnavailable(t, res)
  t.ok(waited >= 90, `the store was given its storeTimeout (${waited} ms)`)
  t.equal(count(), 0)
})

t.test('onStoreError bypass runs the handler unprotected and logs an error every time', async (t) => {
  const { store } = storeWith({ claim: async () => { throw new Error('connection refused') } })
  t.teardown(() => store.close())
  const log = logCapture()
  const app = await buildApp(t, {
    plugin: { store, onStoreError: 'bypass' },
    fastify: { logger: { level: 'error', stream: log.stream } }
  })
  const count = payRoute(app)

  const first = await post(app, 'bypass')
  const second = await post(app, 'bypass')
  t.equal(first.statusCode, 201)
  t.equal(second.statusCode, 201)
  t.equal(count(), 2, 'the handler ran for each request (no protection)')
  t.same(JSON.parse(first.body), { execution: 1, protected: false }, 'request.idempotency is null')
  t.equal(second.headers['idempotent-replayed'], undefined)
  const errors = log.lines.filter((line) => line.level === 50 && line.idempotency?.outcome === 'bypassed')
  t.equal(errors.length, 2, 'one error-level line per bypassed request')
  t.ok(errors.every((line) => /WITHOUT idempotency protection/.test(line.msg)), 'the line says the request ran unprotected')
})

t.test('onStoreError bypass also covers a claim that times out', async (t) => {
  const { store } = storeWith({ claim: () => new Promise(() => {}) })
  t.teardown(() => store.close())
  const log = logCapture()
  const app = await buildApp(t, {
    plugin: { store, onStoreError: 'bypass', storeTimeout: 50 },
    fastify: { logger: { level: 'error', stream: log.stream } }
  })
  const count = payRoute(app)
  const res = await post(app, 'bypass-timeout')
  t.equal(res.statusCode, 201)
  t.equal(count(), 1)
  t.equal(log.lines.filter((line) => line.level === 50 && line.idempotency?.outcome === 'bypassed').length, 1)
})

t.test('a per-route onStoreError overrides the global one', async (t) => {
  const { store } = storeWith({ claim: async () => { throw new Error('down') } })
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store, onStoreError: 'bypass' } })
  let executions = 0
  app.post('/strict', { config: { idempotency: { onStoreError: 'fail' } } }, async () => { executions++; return {} })
  const res = await app.inject({ method: 'POST', url: '/strict', headers: keyed('k'), payload: BODY })
  t.equal(res.statusCode, 503)
  t.equal(executions, 0)
})

t.test('a complete that rejects: the client still gets the real response, after 3 attempts and an error log', async (t) => {
  let completeCalls = 0
  const { store, base } = storeWith({
    complete: async () => {
      completeCalls++
      throw new Error('write failed')
    }
  })
  t.teardown(() => store.close())
  const log = logCapture()
  const app = await buildApp(t, { plugin: { store }, fastify: { logger: { level: 'error', stream: log.stream } } })
  const count = payRoute(app)

  const res = await post(app, 'no-record')
  t.equal(res.statusCode, 201, 'the handler\'s status (its effect happened)')
  t.same(JSON.parse(res.body), { execution: 1, protected: true }, 'the handler\'s body')
  t.equal(completeCalls, 3, 'complete was attempted 3 times')
  const errors = storeErrors(log.lines)
  t.equal(errors.length, 1, 'one error logged once the attempts are exhausted')
  t.equal(errors[0]?.err?.message, 'write failed')

  // Unrecorded, the key stays in progress until its lease lapses: a retry is refused, not re-run.
  t.equal((await base.get({ scope: 'test', key: 'no-record' }))?.state, 'in_progress')
  t.equal((await post(app, 'no-record')).statusCode, 409)
  t.equal(count(), 1)
})

t.test('a complete that fails once is retried and the response is recorded', async (t) => {
  let completeCalls = 0
  const base = memoryStore({ purgeInterval: 0 })
  const store: IdempotencyStore = {
    ...base,
    complete: async (lease, response, ttl) => {
      if (++completeCalls === 1) throw new Error('blip')
      return base.complete(lease, response, ttl)
    }
  }
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store } })
  const count = payRoute(app)
  const first = await post(app, 'blip')
  t.equal(completeCalls, 2)
  const retry = await post(app, 'blip')
  t.equal(retry.headers['idempotent-replayed'], 'true')
  t.equal(retry.body, first.body)
  t.equal(count(), 1)
})

t.test('a release that rejects after a handler throw: the client gets the 500, no unhandled rejection, the key frees itself', async (t) => {
  const unhandled: unknown[] = []
  const onUnhandled = (reason: unknown): void => { unhandled.push(reason) }
  process.on('unhandledRejection', onUnhandled)
  t.teardown(() => { process.off('unhandledRejection', onUnhandled) })

  let releaseCalls = 0
  const { store } = storeWith({
    release: async () => {
      releaseCalls++
      throw new Error('release failed')
    }
  })
  t.teardown(() => store.close())
  const log = logCapture()
  const app = await buildApp(t, { plugin: { store, lease: 100 }, fastify: { logger: { level: 'error', stream: log.stream } } })
  let executions = 0
  app.post('/pay', async (_request, reply) => {
    if (++executions === 1) throw new Error('handler failed')
    reply.code(201)
    return { execution: executions }
  })

  const res = await post(app, 'release-fails')
  t.equal(res.statusCode, 500, 'the client gets the handler\'s failure')
  t.equal(releaseCalls, 3, 'release was tried three times')
  t.equal(storeErrors(log.lines).length, 1, 'the failed release is logged once')
  await sleep(50)
  t.same(unhandled, [], 'no unhandled rejection')

  // The release failed, so the key is held until the lease (100 ms) lapses; never stuck.
  await sleep(150)
  const retry = await post(app, 'release-fails')
  t.equal(retry.statusCode, 201, 'after the lease, a retry executes')
  t.equal(executions, 2)
})

t.test('renew failures keep the owner running and its key is not taken over', async (t) => {
  let renewCalls = 0
  const base = memoryStore({ purgeInterval: 0 })
  const store: IdempotencyStore = {
    ...base,
    renew: async (lease, leaseMs) => {
      if (++renewCalls === 1) throw new Error('renew failed') // one blip, then the store recovers
      return base.renew(lease, leaseMs)
    }
  }
  t.teardown(() => store.close())
  const LEASE = 300 // renewed every 100 ms
  const app = await buildApp(t, { plugin: { store, lease: LEASE } })
  let executions = 0
  app.post('/pay', async (_request, reply) => {
    executions++
    await sleep(700)
    reply.code(201)
    return { execution: executions }
  })

  const startedAt = Date.now()
  const original = post(app, 'renew-blip')
  await sleep(350 - (Date.now() - startedAt))
  const d1 = await post(app, 'renew-blip')
  await sleep(550 - (Date.now() - startedAt))
  const d2 = await post(app, 'renew-blip')
  t.equal(d1.statusCode, 409, 'a duplicate past the first lease is refused')
  t.equal(d2.statusCode, 409, 'and later on too')

  const first = await original
  t.equal(first.statusCode, 201, 'the owner finished')
  t.equal(executions, 1, 'no takeover: one execution')
  t.ok(renewCalls >= 3, `the owner kept renewing after the failure (${renewCalls} renewals)`)
  const retry = await post(app, 'renew-blip')
  t.equal(retry.headers['idempotent-replayed'], 'true', 'and its response was recorded')
  t.equal(retry.body, first.body)
})
