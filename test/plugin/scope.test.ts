import { randomUUID } from 'node:crypto'
import type { FastifyInstance, FastifyRequest, LightMyRequestResponse } from 'fastify'
import t from 'tap'
import { memoryStore } from '../../lib/index.js'
import type { IdempotencyStore } from '../../lib/core/store.js'
import { buildApp, deferred, keyed } from '../helpers/app.js'

/**
 * Behaviour 12: the same key from two scopes is two independent operations; neither sees the
 * other's record, 409 or 422.
 */

const tenant = (request: FastifyRequest): string => request.headers['x-tenant'] as string
const BODY = { amount: 100 }

function post (app: FastifyInstance, key: string, from: string, body: Record<string, unknown> = BODY, url = '/pay'): Promise<LightMyRequestResponse> {
  return app.inject({ method: 'POST', url, headers: keyed(key, { 'x-tenant': from }), payload: body })
}

/** A store wrapper counting claims, to prove a request never reached the store. */
function countingStore (): { store: IdempotencyStore, base: IdempotencyStore, claims: () => number } {
  const base = memoryStore({ purgeInterval: 0 })
  let claims = 0
  return {
    base,
    store: { ...base, claim: (request) => { claims++; return base.claim(request) } },
    claims: () => claims
  }
}

/** POST /pay answering 201 with who it ran for and a unique charge id. */
function payRoute (app: FastifyInstance): () => number {
  let executions = 0
  app.post('/pay', async (request, reply) => {
    executions++
    reply.code(201)
    return { tenant: request.headers['x-tenant'], charge: randomUUID() }
  })
  return () => executions
}

t.test('the same key and body from two scopes are two executions with their own responses', async (t) => {
  const app = await buildApp(t, { plugin: { scope: tenant } })
  const count = payRoute(app)

  const a = await post(app, 'shared-key', 'A')
  const b = await post(app, 'shared-key', 'B')
  t.equal(a.statusCode, 201)
  t.equal(b.statusCode, 201)
  t.equal(b.headers['idempotent-replayed'], undefined, 'B is an execution, not a replay of A')
  t.equal(count(), 2, 'two executions')
  t.match(JSON.parse(b.body), { tenant: 'B' }, 'B never receives A\'s body')
  t.not(b.body, a.body)

  const aAgain = await post(app, 'shared-key', 'A')
  const bAgain = await post(app, 'shared-key', 'B')
  t.equal(aAgain.body, a.body, 'A\'s retry replays A\'s response')
  t.equal(bAgain.body, b.body, 'B\'s retry replays B\'s response')
  t.equal(aAgain.headers['idempotent-replayed'], 'true')
  t.equal(bAgain.headers['idempotent-replayed'], 'true')
  t.equal(count(), 2)
})

t.test('an in-flight request in scope A never gives scope B a 409', async (t) => {
  const app = await buildApp(t, { plugin: { scope: tenant } })
  const started = deferred()
  const gate = deferred()
  let executions = 0
  app.post('/pay', async (request, reply) => {
    executions++
    if (request.headers['x-tenant'] === 'A') {
      started.resolve()
      await gate.promise
    }
    reply.code(201)
    return { tenant: request.headers['x-tenant'] }
  })

  const a = post(app, 'inflight', 'A')
  await started.promise
  t.equal((await post(app, 'inflight', 'A')).statusCode, 409, 'precondition: A\'s own duplicate is refused')
  const b = await post(app, 'inflight', 'B')
  t.equal(b.statusCode, 201, 'B executes while A is in flight')
  t.match(JSON.parse(b.body), { tenant: 'B' })
  gate.resolve()
  t.equal((await a).statusCode, 201)
  t.equal(executions, 2)
})

t.test('a record in scope A made with a different body never gives scope B a 422', async (t) => {
  const app = await buildApp(t, { plugin: { scope: tenant } })
  const count = payRoute(app)

  t.equal((await post(app, 'k', 'A', { amount: 1 })).statusCode, 201)
  t.equal((await post(app, 'k', 'A', { amount: 2 })).statusCode, 422, 'precondition: A reusing its key with another body is 422')
  const b = await post(app, 'k', 'B', { amount: 2 })
  t.equal(b.statusCode, 201, 'B with that other body executes')
  t.match(JSON.parse(b.body), { tenant: 'B' })
  t.equal(count(), 2)
})

t.test('request.idempotency carries the resolved scope', async (t) => {
  const app = await buildApp(t, { plugin: { scope: tenant } })
  app.post('/pay', async (request) => ({ scope: request.idempotency?.scope, key: request.idempotency?.key }))
  const res = await post(app, 'ctx', 'tenant-42')
  t.same(JSON.parse(res.body), { scope: 'tenant-42', key: 'ctx' })
})

t.test('records are stored under the scope the function returned', async (t) => {
  const { store } = countingStore()
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { scope: tenant, store } })
  payRoute(app)
  const res = await post(app, 'where', 'A')
  const record = await store.get({ scope: 'A', key: 'where' })
  t.equal(record?.state, 'completed')
  t.equal(record?.state === 'completed' ? record.response.body?.toString() : null, res.body)
  t.equal(await store.get({ scope: 'B', key: 'where' }), null, 'nothing under another scope')
  t.equal(await store.get({ scope: '', key: 'where' }), null, 'nothing under the global scope')
})

t.test('an async scope function scopes keys the same way', async (t) => {
  const app = await buildApp(t, {
    plugin: {
      scope: async (request) => {
        await new Promise((resolve) => setImmediate(resolve))
        return `async-${tenant(request)}`
      }
    }
  })
  app.post('/pay', async (request, reply) => {
    reply.code(201)
    return { scope: request.idempotency?.scope, charge: randomUUID() }
  })
  const a = await post(app, 'async', 'A')
  const b = await post(app, 'async', 'B')
  t.match(JSON.parse(a.body), { scope: 'async-A' })
  t.match(JSON.parse(b.body), { scope: 'async-B' })
  t.equal(b.headers['idempotent-replayed'], undefined, 'two operations')
  const aAgain = await post(app, 'async', 'A')
  t.equal(aAgain.headers['idempotent-replayed'], 'true', 'and A\'s retry replays A')
  t.equal(aAgain.body, a.body)
})

t.test('a scope function that throws answers 500 and stores nothing', async (t) => {
  const { store, claims } = countingStore()
  t.teardown(() => store.close())
  const app = await buildApp(t, {
    plugin: {
      store,
      scope: (request) => {
        if (request.headers['x-tenant'] === undefined) throw new Error('no principal')
        return tenant(request)
      }
    }
  })
  let executions = 0
  app.post('/pay', async (_request, reply) => { executions++; reply.code(201); return { ok: true } })

  const res = await app.inject({ method: 'POST', url: '/pay', headers: keyed('throws'), payload: BODY })
  t.equal(res.statusCode, 500)
  t.equal(executions, 0, 'the handler did not run')
  t.equal(claims(), 0, 'the store was never asked')
  t.notMatch(res.body, /at .*\.ts:\d+/, 'no stack trace in the answer')

  const retry = await post(app, 'throws', 'A')
  t.equal(retry.statusCode, 201, 'the same key with a resolvable scope executes')
  t.equal(retry.headers['idempotent-replayed'], undefined)
  t.equal(executions, 1)
})

t.test('a scope function that rejects answers 500 and stores nothing', async (t) => {
  const { store, claims } = countingStore()
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store, scope: async () => { throw new Error('lookup failed') } } })
  let executions = 0
  app.post('/pay', async () => { executions++; return { ok: true } })
  const res = await post(app, 'rejects', 'A')
  t.equal(res.statusCode, 500)
  t.equal(executions, 0)
  t.equal(claims(), 0)
})

t.test('a scope function returning a non-string answers 500 and stores nothing', async (t) => {
  for (const [label, value] of [['undefined', undefined], ['number', 42], ['null', null], ['object', { id: 'A' }]] as const) {
    await t.test(label, async (t) => {
      const { store, claims } = countingStore()
      t.teardown(() => store.close())
      const app = await buildApp(t, { plugin: { store, scope: () => value as unknown as string } })
      let executions = 0
      app.post('/pay', async () => { executions++; return { ok: true } })
      const res = await post(app, `non-string-${label}`, 'A')
      t.equal(res.statusCode, 500)
      t.equal(executions, 0, 'the handler did not run')
      t.equal(claims(), 0, 'the store was never asked')
    })
  }
})

t.test('a per-route scope overrides the global one', async (t) => {
  const { store } = countingStore()
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store, scope: tenant } })
  let executions = 0
  app.post('/shared', { config: { idempotency: { scope: () => 'route-wide' } } }, async (request, reply) => {
    executions++
    reply.code(201)
    return { scope: request.idempotency?.scope, charge: randomUUID() }
  })

  const a = await post(app, 'route-key', 'A', BODY, '/shared')
  const b = await post(app, 'route-key', 'B', BODY, '/shared')
  t.match(JSON.parse(a.body), { scope: 'route-wide' })
  t.equal(b.headers['idempotent-replayed'], 'true', 'the route\'s scope ignores the tenant header: B replays A')
  t.equal(b.body, a.body)
  t.equal(executions, 1)
  t.equal((await store.get({ scope: 'route-wide', key: 'route-key' }))?.state, 'completed')
  t.equal(await store.get({ scope: 'A', key: 'route-key' }), null, 'the global scope function was not used')
})
