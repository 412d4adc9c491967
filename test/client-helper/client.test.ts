import type { FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import { memoryStore, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import { createIdempotentClient, NoAnswerError, type IdempotentClientOptions } from '../../client/index.js'
import { buildApp, deferred, PROBLEM_TYPE } from '../helpers/app.js'
import { startFaultProxy, type FaultProxy } from '../helpers/fault-proxy.js'

/*
 * The client against the real plugin on a real socket: one key per logical operation, reused on
 * every retry; which outcomes are retried (network errors, timeouts, 409, 503) and which are final;
 * Retry-After and backoff observed through an injected sleep.
 */

const UUID_V4 = /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/

interface Seen { readonly method: string, readonly url: string, readonly keyHeader: string | undefined }

interface Server<R> {
  /** What `routes` returned. */
  readonly routes: R
  readonly app: FastifyInstance
  readonly store: IdempotencyStore
  readonly port: number
  readonly baseUrl: string
  /** Every request the server received, in arrival order, including those the plugin answered itself. */
  readonly seen: Seen[]
}

/** The plugin on a memory store (scope `test`), `routes` declared, listening on 127.0.0.1. */
async function serve<R> (t: Test, routes: (app: FastifyInstance) => R, plugin: IdempotencyOptions = {}): Promise<Server<R>> {
  const store = plugin.store ?? memoryStore({ purgeInterval: 0 })
  // undici keeps an aborted attempt's socket until its own 4 s keep-alive ends, and Fastify's close
  // waits for it: close them all so teardown is immediate.
  const app = await buildApp(t, { plugin: { ...plugin, store }, fastify: { forceCloseConnections: true } })
  const seen: Seen[] = []
  app.addHook('onRequest', async (request) => {
    const keyHeader = request.headers['idempotency-key']
    seen.push({ method: request.method, url: request.url, keyHeader: typeof keyHeader === 'string' ? keyHeader : undefined })
  })
  const declared = routes(app)
  await app.listen({ host: '127.0.0.1', port: 0 })
  const address = app.server.address()
  const port = typeof address === 'object' && address !== null ? address.port : 0
  return { routes: declared, app, store, port, baseUrl: `http://127.0.0.1:${port}`, seen }
}

async function proxyTo (t: Test, server: Server<unknown>): Promise<FaultProxy> {
  const proxy = await startFaultProxy({ host: '127.0.0.1', port: server.port })
  t.teardown(async () => { await proxy.close() })
  return proxy
}

/** A sleep that returns at once and records what it was asked to wait; `onSleep` runs first. */
function recordingSleep (onSleep: (call: number, ms: number) => void | Promise<void> = () => {}): { delays: number[], sleep: NonNullable<IdempotentClientOptions['sleep']> } {
  const delays: number[] = []
  return { delays, sleep: async (ms) => { delays.push(ms); await onSleep(delays.length, ms) } }
}

/** A POST /pay that counts executions per key and answers 201 with a body unique to the execution. */
function payRoute (app: FastifyInstance): { runs: Map<string, number>, bodies: Map<string, string> } {
  const runs = new Map<string, number>()
  const bodies = new Map<string, string>()
  let sequence = 0
  app.post('/pay', async (request, reply) => {
    const key = request.idempotency?.key ?? '(none)'
    runs.set(key, (runs.get(key) ?? 0) + 1)
    const body = JSON.stringify({ id: `pay_${++sequence}`, key, amount: (request.body as { amount: number }).amount })
    bodies.set(key, body)
    return reply.code(201).type('application/json').send(body)
  })
  return { runs, bodies }
}

async function completed (store: IdempotencyStore, key: string): Promise<void> {
  for (let i = 0; i < 500; i++) {
    if ((await store.get({ scope: 'test', key }))?.state === 'completed') return
    await new Promise((resolve) => setTimeout(resolve, 5))
  }
  throw new Error(`the record of ${key} never completed`)
}

t.test('a POST gets one UUID v4 key, generated before the first attempt and sent as an sf-string on every retry', async (t) => {
  const server = await serve(t, payRoute)
  const { runs, bodies } = server.routes
  const proxy = await proxyTo(t, server)
  proxy.set({ dropReplyProbability: 1 })
  const { delays, sleep } = recordingSleep((call) => { if (call === 2) proxy.set({ dropReplyProbability: 0 }) })
  const client = createIdempotentClient({ baseUrl: `http://127.0.0.1:${proxy.port}`, sleep })

  const result = await client.post('/pay', { body: { amount: 100 } })

  t.match(result.key, UUID_V4, 'the key is a UUID v4')
  const key = result.key as string
  t.equal(server.seen.length, 3, 'the server saw three attempts')
  t.same(server.seen.map((s) => s.keyHeader), [`"${key}"`, `"${key}"`, `"${key}"`], 'every attempt carried the same key, quoted (draft §2.1)')
  t.same([...runs], [[key, 1]], 'the handler ran once, under that key')
  t.equal(proxy.stats.dropped, 2, 'the first two answers were lost on the way back')
  t.equal(result.status, 201)
  t.equal(result.replayed, true, 'the answer is the replay of the first execution')
  t.equal(result.attempts, 3)
  t.equal(result.text(), bodies.get(key), 'the body is the one execution\'s')
  t.equal(delays.length, 2, 'two waits, one before each retry')
})

t.test('each call is its own operation: two calls with equal bodies get two keys and run twice', async (t) => {
  const server = await serve(t, payRoute)
  const { runs } = server.routes
  const client = createIdempotentClient({ baseUrl: server.baseUrl })

  const [a, b] = [await client.post('/pay', { body: { amount: 1 } }), await client.post('/pay', { body: { amount: 1 } })]
  t.not(a.key, b.key)
  t.same([a.status, a.replayed, b.status, b.replayed], [201, false, 201, false])
  t.equal(runs.size, 2, 'two executions, one per key')
})

t.test('a caller-supplied key is used as is, escaped as an sf-string even for a strict server, and resumes the operation', async (t) => {
  const server = await serve(t, payRoute, { keyFormat: 'strict' })
  const { runs } = server.routes
  const client = createIdempotentClient({ baseUrl: server.baseUrl })
  const key = 'order-42 "retry" \\ 7'

  const first = await client.post('/pay', { key, body: { amount: 7 } })
  t.equal(first.status, 201, 'a strict server accepted the key')
  t.equal(first.key, key)
  t.same([...runs.keys()], [key], 'the server parsed back exactly the caller\'s key')
  t.equal(server.seen[0]?.keyHeader, '"order-42 \\"retry\\" \\\\ 7"', 'quotes and backslashes escaped (RFC 9651 §3.3.3)')

  const again = await client.post('/pay', { key, body: { amount: 7 } })
  t.equal(again.replayed, true, 'the same key later is the same operation: replayed')
  t.equal(again.text(), first.text())
  t.equal(runs.get(key), 1, 'the handler still ran once')
})

t.test('GET, PUT and DELETE are sent without a key unless the caller gives one; other methods get one', async (t) => {
  const server = await serve(t, (app) => {
    for (const method of ['GET', 'PUT', 'DELETE', 'PATCH'] as const) app.route({ method, url: '/thing', handler: async () => ({ ok: true }) })
  })
  const client = createIdempotentClient({ baseUrl: server.baseUrl })

  const get = await client.get('/thing')
  const put = await client.put('/thing', { body: { a: 1 } })
  const del = await client.delete('/thing')
  const keyedPut = await client.put('/thing', { body: { a: 1 }, key: 'put-1' })
  const patch = await client.patch('/thing', { body: { a: 1 } })
  t.same([get.key, put.key, del.key], [null, null, null], 'idempotent methods (RFC 9110 §9.2.2): no key')
  t.same(server.seen.slice(0, 3).map((s) => s.keyHeader), [undefined, undefined, undefined], 'and no header was sent')
  t.equal(keyedPut.key, 'put-1')
  t.equal(server.seen[3]?.keyHeader, '"put-1"')
  t.match(patch.key, UUID_V4, 'PATCH gets a key')
  t.equal(server.seen[4]?.keyHeader, `"${patch.key}"`)
})

t.test('an attempt that times out is retried with the same key; the 409 while the original runs is retried after Retry-After; the answer is the replay', async (t) => {
  const gate = deferred()
  let runs = 0
  const server = await serve(t, (app) => {
    app.post('/slow', async (_request, reply) => {
      runs++
      await gate.promise
      return reply.code(201).send({ charge: `ch_${runs}` })
    })
  })
  let key = ''
  const { delays, sleep } = recordingSleep(async (call) => {
    key = (server.seen[0]?.keyHeader ?? '').slice(1, -1)
    if (call === 2) {
      gate.resolve()
      await completed(server.store, key)
    }
  })
  const client = createIdempotentClient({ baseUrl: server.baseUrl, timeoutMs: 150, sleep, random: () => 0 })

  const result = await client.post('/slow', { body: {} })

  t.equal(runs, 1, 'the handler ran once')
  t.equal(server.seen.length, 3, 'timed out, 409, replayed')
  t.ok(server.seen.every((s) => s.keyHeader === `"${key}"`), 'all with the same key')
  t.same(delays, [0, 1000], 'no wait after the timeout (random 0), then the 409\'s Retry-After: 1')
  t.same([result.status, result.replayed, result.attempts, result.key], [201, true, 3, key])
  t.same(result.json(), { charge: 'ch_1' })
})

t.test('a 409 for an operation in flight is retried no sooner than its Retry-After, then replays the original', async (t) => {
  const gate = deferred()
  let runs = 0
  const server = await serve(t, (app) => {
    app.post('/pay', async (_request, reply) => {
      runs++
      await gate.promise
      return reply.code(201).send({ charge: runs })
    })
  }, { retryAfter: 2 })
  const original = server.app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': '"k-409"', 'content-type': 'application/json' }, payload: {} })
  while (runs === 0) await new Promise((resolve) => setTimeout(resolve, 2))
  const { delays, sleep } = recordingSleep(async () => { gate.resolve(); await original })
  const client = createIdempotentClient({ baseUrl: server.baseUrl, sleep, random: () => 0.999, backoff: { baseMs: 100, maxMs: 100 } })

  const result = await client.post('/pay', { key: 'k-409', body: {} })

  t.same(delays, [2000], 'the server\'s Retry-After (2 s) beats the jittered backoff (< 100 ms)')
  t.same([result.status, result.replayed, result.attempts], [201, true, 2])
  t.equal(result.text(), (await original).body, 'the original\'s body')
  t.equal(runs, 1)
})

t.test('a 503 (store unavailable) is retried after its Retry-After and the operation runs once', async (t) => {
  const base = memoryStore({ purgeInterval: 0 })
  t.teardown(() => base.close())
  let claims = 0
  const store: IdempotencyStore = { ...base, claim: async (request) => { if (++claims === 1) throw new Error('connection refused'); return base.claim(request) } }
  const server = await serve(t, payRoute, { store, retryAfter: 3 })
  const { runs } = server.routes
  const { delays, sleep } = recordingSleep()
  const client = createIdempotentClient({ baseUrl: server.baseUrl, sleep, random: () => 0 })

  const result = await client.post('/pay', { body: { amount: 3 } })

  t.same(delays, [3000], 'Retry-After: 3')
  t.same([result.status, result.replayed, result.attempts], [201, false, 2], 'the first attempt never reached the handler, the second executed')
  t.same([...runs.values()], [1])
  t.equal(server.seen[0]?.keyHeader, server.seen[1]?.keyHeader)
})

t.test('Retry-After as an HTTP-date is measured against the response\'s Date', async (t) => {
  let runs = 0
  const server = await serve(t, (app) => {
    app.post('/busy', async (_request, reply) => {
      // 5xx is not recorded by default: the key is released and the retry executes again.
      if (++runs === 1) {
        return reply.code(503).header('date', 'Sun, 06 Nov 1994 08:49:37 GMT').header('retry-after', 'Sun, 06 Nov 1994 08:49:41 GMT').send({ busy: true })
      }
      return reply.code(201).send({ done: runs })
    })
  })
  const { delays, sleep } = recordingSleep()
  const client = createIdempotentClient({ baseUrl: server.baseUrl, sleep, random: () => 0 })

  const result = await client.post('/busy', { body: {} })
  t.same(delays, [4000], '4 s after the server\'s Date, whatever the client\'s clock says')
  t.same([result.status, result.attempts], [201, 2])
})

t.test('network errors back off exponentially with full jitter, capped by backoff.maxMs', async (t) => {
  const server = await serve(t, payRoute)
  const { runs } = server.routes
  const proxy = await proxyTo(t, server)
  proxy.set({ dropReplyProbability: 1 })
  const { delays, sleep } = recordingSleep((call) => { if (call === 4) proxy.set({ dropReplyProbability: 0 }) })
  const client = createIdempotentClient({ baseUrl: `http://127.0.0.1:${proxy.port}`, sleep, random: () => 0.5, maxAttempts: 5, backoff: { baseMs: 100, maxMs: 300 } })

  const result = await client.post('/pay', { body: { amount: 1 } })
  t.same(delays, [50, 100, 150, 150], 'half of 100, 200, then the 300 cap')
  t.same([result.status, result.replayed, result.attempts], [201, true, 5])
  t.same([...runs.values()], [1])
})

t.test('422, 400, 404, 500 and 2xx answers are final: exactly one attempt', async (t) => {
  const server = await serve(t, (app) => {
    app.post('/fail', async () => { throw new Error('boom') })
    return payRoute(app)
  }, { maxKeyLength: 16 })
  const { runs } = server.routes
  const { delays, sleep } = recordingSleep()
  const client = createIdempotentClient({ baseUrl: server.baseUrl, sleep })

  const created = await client.post('/pay', { key: 'reused-1', body: { amount: 1 } })
  const reused = await client.post('/pay', { key: 'reused-1', body: { amount: 2 } })
  const tooLong = await client.post('/pay', { key: 'k'.repeat(17), body: { amount: 1 } })
  const missing = await client.post('/nowhere', { body: {} })
  const failed = await client.post('/fail', { key: 'fail-1', body: {} })

  t.same([created.status, reused.status, tooLong.status, missing.status, failed.status], [201, 422, 400, 404, 500])
  t.same([created, reused, tooLong, missing, failed].map((r) => r.attempts), [1, 1, 1, 1, 1], 'one attempt each')
  t.equal(server.seen.length, 5, 'the server saw one request per call')
  t.same(delays, [], 'no waits')
  t.same([...runs], [['reused-1', 1]], 'the different body under a used key never ran')
  t.match(reused.problem, { type: PROBLEM_TYPE('key-reused'), status: 422, title: 'Idempotency-Key is already used' }, 'the 422 problem, parsed')
  t.match(tooLong.problem, { type: PROBLEM_TYPE('key-invalid'), status: 400 })
  t.equal(missing.problem, null, 'Fastify\'s 404 is application/json, not a problem')
  t.equal(created.problem, null)
})

t.test('a replayed answer is final even with a retryable status: the handler\'s own 409 is asked once more, then kept', async (t) => {
  let runs = 0
  const server = await serve(t, (app) => {
    app.post('/transfer', async (_request, reply) => { runs++; return reply.code(409).send({ error: 'insufficient funds' }) })
  })
  const { sleep } = recordingSleep()
  const client = createIdempotentClient({ baseUrl: server.baseUrl, sleep, maxAttempts: 5 })

  const result = await client.post('/transfer', { body: {} })
  t.equal(runs, 1, 'the recorded 409 (draft §2.6) was replayed, not executed again')
  t.same([result.status, result.replayed, result.attempts], [409, true, 2], 'stops at the replay instead of using all 5 attempts')
  t.same(result.json(), { error: 'insufficient funds' })
})

t.test('when 503s outlast maxAttempts the last answer is returned, its problem parsed', async (t) => {
  const base = memoryStore({ purgeInterval: 0 })
  t.teardown(() => base.close())
  const store: IdempotencyStore = { ...base, claim: async () => { throw new Error('down') } }
  const server = await serve(t, payRoute, { store })
  const { runs } = server.routes
  const { delays, sleep } = recordingSleep()
  const client = createIdempotentClient({ baseUrl: server.baseUrl, sleep, maxAttempts: 3, random: () => 0 })

  const result = await client.post('/pay', { body: { amount: 1 } })
  t.same([result.status, result.attempts, result.ok], [503, 3, false])
  t.match(result.problem, { type: PROBLEM_TYPE('store-unavailable'), status: 503 })
  t.equal(server.seen.length, 3)
  t.equal(new Set(server.seen.map((s) => s.keyHeader)).size, 1, 'one key throughout')
  t.same(delays, [1000, 1000])
  t.equal(runs.size, 0)
})

t.test('when no attempt gets an answer, NoAnswerError carries the key, and resuming with it replays the one execution', async (t) => {
  const server = await serve(t, payRoute)
  const { runs, bodies } = server.routes
  const proxy = await proxyTo(t, server)
  proxy.set({ dropReplyProbability: 1 })
  const { sleep } = recordingSleep()
  const client = createIdempotentClient({ baseUrl: `http://127.0.0.1:${proxy.port}`, sleep, maxAttempts: 4 })

  const error = await client.post('/pay', { body: { amount: 9 } }).then(() => null, (err: unknown) => err)
  t.ok(error instanceof NoAnswerError, 'rejects with NoAnswerError')
  const noAnswer = error as NoAnswerError
  t.same([noAnswer.attempts, noAnswer.reason, noAnswer.code], [4, 'attempts', 'IDEMPOTENCY_CLIENT_NO_ANSWER'])
  t.match(noAnswer.key, UUID_V4)
  t.ok(noAnswer.cause instanceof Error, 'the last network error is the cause')
  t.equal(server.seen.length, 4, 'four attempts reached the server')
  t.same([...runs], [[noAnswer.key, 1]], 'and the operation ran once')

  proxy.set({ dropReplyProbability: 0 })
  const resumed = await client.post('/pay', { key: noAnswer.key as string, body: { amount: 9 } })
  t.same([resumed.status, resumed.replayed, resumed.attempts], [201, true, 1])
  t.equal(resumed.text(), bodies.get(noAnswer.key as string))
  t.equal(runs.get(noAnswer.key as string), 1)
})

t.test('the overall deadline stops retrying even with attempts left; the wait counts against it', async (t) => {
  const base = memoryStore({ purgeInterval: 0 })
  t.teardown(() => base.close())
  const store: IdempotencyStore = { ...base, claim: async () => { throw new Error('down') } }
  const server = await serve(t, payRoute, { store })
  let clock = 0
  const { delays, sleep } = recordingSleep((_call, ms) => { clock += ms })
  const client = createIdempotentClient({ baseUrl: server.baseUrl, sleep, now: () => clock, maxAttempts: 10, deadlineMs: 2_500, random: () => 0 })

  const result = await client.post('/pay', { body: { amount: 1 } })
  t.same(delays, [1000, 1000], 'a third wait of 1 s would end past 2.5 s')
  t.same([result.status, result.attempts], [503, 3])
})

t.test('the caller\'s signal cancels a wait and an attempt in flight; nothing more is sent', async (t) => {
  const gate = deferred()
  t.teardown(() => gate.resolve())
  const base = memoryStore({ purgeInterval: 0 })
  t.teardown(() => base.close())
  let claims = 0
  const store: IdempotencyStore = { ...base, claim: async (request) => { if (++claims === 1) throw new Error('down'); return base.claim(request) } }
  const server = await serve(t, (app) => {
    app.post('/hang', async () => { await gate.promise; return {} })
  }, { store })
  const client = createIdempotentClient({ baseUrl: server.baseUrl, backoff: { baseMs: 60_000, maxMs: 60_000 }, random: () => 0.5 })

  const duringWait = new AbortController()
  const waiting = client.post('/hang', { body: {}, signal: duringWait.signal })
  while (server.seen.length < 1) await new Promise((resolve) => setTimeout(resolve, 2))
  duringWait.abort(new Error('user left'))
  await t.rejects(waiting, { message: 'user left' }, 'the 503\'s wait was cancelled with the caller\'s reason')
  t.equal(server.seen.length, 1, 'no retry was sent')

  const duringAttempt = new AbortController()
  const hanging = client.post('/hang', { body: {}, signal: duringAttempt.signal })
  while (server.seen.length < 2) await new Promise((resolve) => setTimeout(resolve, 2))
  duringAttempt.abort(new Error('cancelled'))
  await t.rejects(hanging, { message: 'cancelled' })
  t.equal(server.seen.length, 2)
  gate.resolve()
})
