import http from 'node:http'
import type { AddressInfo } from 'node:net'
import type { FastifyInstance, FastifyReply, FastifyServerOptions, InjectOptions, RouteShorthandOptions } from 'fastify'
import t, { type Test } from 'tap'
import { memoryStore, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import type { StoredRecord } from '../../lib/core/store.js'
import { buildApp, deferred, eventually, keyed, PROBLEM_TYPE } from '../helpers/app.js'
import { sleep } from '../helpers/sleep.js'

/*
 * Behaviour 9 of the contract: a handler failure (a thrown error, or a response the `record` rule
 * excludes: 5xx and 429 by default) releases the claim, so a retry executes again; a request that
 * ends without a response it can record (client abort, socket timeout, reply.hijack()) never
 * leaves its key stuck: it is released, recorded when the handler still answers, or its lease
 * lapses.
 */

const SCOPE = 'test'

type MemoryStore = ReturnType<typeof memoryStore>

async function setup (t: Test, plugin: IdempotencyOptions = {}, fastify?: FastifyServerOptions) {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store, ...plugin }, fastify })
  return { app, store }
}

function pay (key: string, payload: object = { amount: 100 }): InjectOptions {
  return { method: 'POST', url: '/pay', headers: keyed(key), payload }
}

/**
 * The shared second half of the release tests: right after the failed attempt the store holds
 * nothing; the retry executes (the handler's second run answers 201), and a third request replays.
 */
async function retryExecutesAgain (t: Test, app: FastifyInstance, store: MemoryStore, key: string, runs: () => number): Promise<void> {
  t.equal(runs(), 1, 'the failed attempt ran the handler once')
  t.equal(await store.get({ scope: SCOPE, key }), null, 'the claim was released: no record, in progress or completed')

  const retry = await app.inject(pay(key))
  t.equal(retry.statusCode, 201, 'the retry executes (neither a replay of the failure nor a 409)')
  t.equal(retry.headers['idempotent-replayed'], undefined)
  t.equal(runs(), 2, 'the handler ran again')

  const again = await app.inject(pay(key))
  t.equal(again.statusCode, 201)
  t.equal(again.headers['idempotent-replayed'], 'true', 'the successful retry is what gets recorded and replayed')
  t.equal(runs(), 2)
}

/** POST /pay whose first run fails as `fail` says and whose later runs answer 201. */
function flakyRoute (app: FastifyInstance, fail: (reply: FastifyReply) => unknown, options: RouteShorthandOptions = {}): { runs: () => number } {
  let runs = 0
  app.post('/pay', options, async (_request, reply) => {
    runs++
    if (runs === 1) return fail(reply)
    return reply.code(201).send({ id: `ch_${runs}` })
  })
  return { runs: () => runs }
}

t.test('a thrown error (500 from the default error handler) releases the claim: the retry executes', async (t) => {
  const { app, store } = await setup(t)
  const route = flakyRoute(app, () => { throw new Error('payment gateway exploded') })

  const failed = await app.inject(pay('throw-1'))
  t.equal(failed.statusCode, 500)
  t.notMatch(failed.body, /at .*\.ts:\d+/, 'no stack trace reaches the client')
  await retryExecutesAgain(t, app, store, 'throw-1', route.runs)
})

t.test('a thrown error with statusCode 400 also releases: a thrown error is a failure whatever its status', async (t) => {
  const { app, store } = await setup(t)
  const route = flakyRoute(app, () => { throw Object.assign(new Error('upstream said no'), { statusCode: 400 }) })

  const failed = await app.inject(pay('throw-400'))
  t.equal(failed.statusCode, 400)
  t.match(failed.json(), { message: 'upstream said no' })
  await retryExecutesAgain(t, app, store, 'throw-400', route.runs)
})

t.test('a handler reply of 503 is not recorded: the retry executes', async (t) => {
  const { app, store } = await setup(t)
  const route = flakyRoute(app, (reply) => reply.code(503).header('retry-after', '2').send({ error: 'gateway_unavailable' }))

  const failed = await app.inject(pay('503-1'))
  t.equal(failed.statusCode, 503)
  t.same(failed.json(), { error: 'gateway_unavailable' }, "the client gets the handler's own answer")
  await retryExecutesAgain(t, app, store, '503-1', route.runs)
})

t.test('a handler reply of 429 is not recorded: the retry executes', async (t) => {
  const { app, store } = await setup(t)
  const route = flakyRoute(app, (reply) => reply.code(429).send({ error: 'slow_down' }))

  const failed = await app.inject(pay('429-1'))
  t.equal(failed.statusCode, 429)
  await retryExecutesAgain(t, app, store, '429-1', route.runs)
})

t.test('a 500 sent by reply.code(500) is released by the default record rule', async (t) => {
  const { app, store } = await setup(t)
  const route = flakyRoute(app, (reply) => reply.code(500).send({ error: 'internal' }))

  const failed = await app.inject(pay('500-1'))
  t.equal(failed.statusCode, 500)
  t.same(failed.json(), { error: 'internal' })
  await retryExecutesAgain(t, app, store, '500-1', route.runs)
})

t.test('a custom record rule (s < 400) releases a 409 sent by the handler', async (t) => {
  const { app, store } = await setup(t, { record: (statusCode) => statusCode < 400 })
  const route = flakyRoute(app, (reply) => reply.code(409).send({ error: 'balance_locked' }))

  const failed = await app.inject(pay('rule-1'))
  t.equal(failed.statusCode, 409)
  t.same(failed.json(), { error: 'balance_locked' })
  await retryExecutesAgain(t, app, store, 'rule-1', route.runs)
})

t.test('a custom record rule set on the route applies to that route', async (t) => {
  const { app, store } = await setup(t)
  const route = flakyRoute(app, (reply) => reply.code(409).send({ error: 'balance_locked' }),
    { config: { idempotency: { record: (statusCode) => statusCode < 400 } } })

  t.equal((await app.inject(pay('rule-2'))).statusCode, 409)
  await retryExecutesAgain(t, app, store, 'rule-2', route.runs)
})

t.test('an error thrown by a route preSerialization hook (after the handler returned) releases', async (t) => {
  const { app, store } = await setup(t)
  let hookCalls = 0
  let runs = 0
  app.post('/pay', {
    preSerialization: async (_request, _reply, payload) => {
      hookCalls++
      if (hookCalls === 1) throw new Error('serializer hook failed')
      return payload
    }
  }, async (_request, reply) => {
    runs++
    reply.code(201)
    return { id: `ch_${runs}` }
  })

  const failed = await app.inject(pay('preser-1'))
  t.equal(failed.statusCode, 500)
  await retryExecutesAgain(t, app, store, 'preser-1', () => runs)
})

t.test('an error thrown by a hook after the response was recorded does not undo the record: the effect happened, so the retry replays it', async (t) => {
  const { app, store } = await setup(t)
  let hookCalls = 0
  let runs = 0
  app.post('/pay', {
    onSend: async (_request, _reply, payload) => {
      hookCalls++
      if (hookCalls === 1) throw new Error('response signing failed')
      return payload
    }
  }, async (_request, reply) => {
    runs++
    return reply.code(201).send({ id: `ch_${runs}` })
  })

  const failed = await app.inject(pay('onsend-1'))
  t.equal(failed.statusCode, 500, 'the client was told the request failed')
  const record = await store.get({ scope: SCOPE, key: 'onsend-1' })
  t.equal(record?.state, 'completed', "the handler's outcome was recorded before the later hook threw")
  const retry = await app.inject(pay('onsend-1'))
  t.equal(retry.statusCode, 201, 'the retry learns the true outcome instead of charging again')
  t.same(retry.json(), { id: 'ch_1' })
  t.equal(retry.headers['idempotent-replayed'], 'true')
  t.equal(runs, 1, 'the handler ran once')
})

t.test('reply.hijack() with a raw write releases the key: the retry runs again, never a 409', async (t) => {
  const { app, store } = await setup(t)
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    runs++
    reply.hijack()
    reply.raw.writeHead(201, { 'content-type': 'text/plain' })
    reply.raw.end(`raw ${runs}`)
  })

  const first = await app.inject(pay('hijack-1'))
  t.equal(first.statusCode, 201)
  t.equal(first.body, 'raw 1')
  t.ok(await eventually(async () => (await store.get({ scope: SCOPE, key: 'hijack-1' })) === null),
    'the key is released once the hijacked response ends')

  const retry = await app.inject(pay('hijack-1'))
  t.equal(retry.statusCode, 201, 'not 409: the key is not stuck')
  t.equal(retry.body, 'raw 2', 'a hijacked response cannot be recorded, so the retry executes')
  t.equal(retry.headers['idempotent-replayed'], undefined)
  t.equal(runs, 2)
  t.ok(await eventually(async () => (await store.get({ scope: SCOPE, key: 'hijack-1' })) === null), 'and is released again')
})

t.test('reply.hijack() still protects against concurrent duplicates while it runs', async (t) => {
  const { app } = await setup(t)
  const entered = deferred()
  const gate = deferred()
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    runs++
    reply.hijack()
    entered.resolve()
    await gate.promise
    reply.raw.writeHead(201, { 'content-type': 'text/plain' })
    reply.raw.end('raw')
  })

  const original = app.inject(pay('hijack-2'))
  await entered.promise
  const duplicate = await app.inject(pay('hijack-2'))
  t.equal(duplicate.statusCode, 409)
  t.match(duplicate.json(), { type: PROBLEM_TYPE('request-in-progress') })
  gate.resolve()
  t.equal((await original).statusCode, 201)
  t.equal(runs, 1)
})

// ---------------------------------------------------------------------------------------------
// Requests that end without a response reaching the client: a real server on 127.0.0.1:0.

interface ClientOutcome { readonly error: string | null, readonly statusCode: number | null }

/** Sends POST /pay with a key over a real connection; `abort()` destroys it from the client side. */
function rawPost (port: number, key: string, body: string): { outcome: Promise<ClientOutcome>, abort: () => void } {
  let abort!: () => void
  const outcome = new Promise<ClientOutcome>((resolve) => {
    const req = http.request({
      host: '127.0.0.1',
      port,
      method: 'POST',
      path: '/pay',
      headers: { ...keyed(key), 'content-length': String(Buffer.byteLength(body)) },
      agent: false
    }, (res) => {
      res.resume()
      res.on('end', () => resolve({ error: null, statusCode: res.statusCode ?? null }))
      res.on('error', (err) => resolve({ error: err.message, statusCode: res.statusCode ?? null }))
    })
    req.on('error', (err) => resolve({ error: err.message, statusCode: null }))
    req.end(body)
    abort = () => req.destroy()
  })
  return { outcome, abort }
}

async function listen (app: FastifyInstance): Promise<number> {
  await app.listen({ port: 0, host: '127.0.0.1' })
  return (app.server.address() as AddressInfo).port
}

t.test('a client abort while the handler runs: the handler finishes, its response is recorded, and a retry replays it', async (t) => {
  const { app, store } = await setup(t)
  const entered = deferred()
  const gate = deferred()
  const closed = deferred()
  t.teardown(() => gate.resolve())
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    runs++
    reply.raw.once('close', () => closed.resolve())
    entered.resolve()
    await gate.promise
    return reply.code(201).send({ id: `ch_${runs}` })
  })
  const port = await listen(app)

  const client = rawPost(port, 'abort-1', '{"amount":100}')
  await entered.promise
  client.abort()
  const outcome = await client.outcome
  t.ok(outcome.error, 'the client gave up before the answer')
  t.equal(outcome.statusCode, null)
  await closed.promise // the server saw the connection go

  t.equal((await store.get({ scope: SCOPE, key: 'abort-1' }))?.state, 'in_progress', 'the abort does not release the key while the handler runs')
  const duplicate = await app.inject(pay('abort-1'))
  t.equal(duplicate.statusCode, 409, 'a retry while the handler still runs is refused, not executed twice')

  gate.resolve()
  t.ok(await eventually(async () => (await store.get({ scope: SCOPE, key: 'abort-1' }))?.state === 'completed'),
    'the effect happened, so its response is recorded although nobody received it')

  const retry = await app.inject(pay('abort-1'))
  t.equal(retry.statusCode, 201)
  t.equal(retry.headers['idempotent-replayed'], 'true')
  t.same(retry.json(), { id: 'ch_1' })
  t.equal(runs, 1, 'the charge was made once')
})

t.test('a socket timeout (connectionTimeout) while the handler runs: the key is never stuck', async (t) => {
  const { app, store } = await setup(t, {}, { connectionTimeout: 50 })
  const gate = deferred()
  const timedOut = deferred()
  t.teardown(() => gate.resolve())
  app.addHook('onTimeout', async () => { timedOut.resolve() })
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    runs++
    await gate.promise
    return reply.code(201).send({ id: `ch_${runs}` })
  })
  const port = await listen(app)

  const client = rawPost(port, 'timeout-1', '{"amount":100}')
  await timedOut.promise
  const outcome = await client.outcome
  t.ok(outcome.error, 'the server dropped the connection')
  t.equal(runs, 1)
  t.equal((await store.get({ scope: SCOPE, key: 'timeout-1' }))?.state, 'in_progress', 'the handler still runs: the key is held')

  gate.resolve()
  // Observed with Fastify 5: the handler still answers after the timeout, so the outcome is
  // recorded as after a client abort. Either way a retry must replay or execute, never get 409.
  t.ok(await eventually(async () => (await store.get({ scope: SCOPE, key: 'timeout-1' }))?.state !== 'in_progress'),
    'once the handler finished, the key is no longer in progress')
  t.equal((await store.get({ scope: SCOPE, key: 'timeout-1' }))?.state, 'completed', 'the response was recorded')

  const retry = await app.inject(pay('timeout-1'))
  t.not(retry.statusCode, 409, 'not stuck')
  t.equal(retry.statusCode, 201)
  t.equal(retry.headers['idempotent-replayed'], 'true', 'the recorded outcome is replayed')
  t.equal(runs, 1)
})

t.test('a client that leaves while a slow handler runs: the key stays with the live owner (409) and its outcome is recorded', async (t) => {
  // Lease 300 ms, handler 1.5 s, the client leaves at 200 ms and retries at
  // 800 ms. The retry used to take the key over (the abort stopped the renewals) and charge twice.
  const LEASE = 300
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  let renewals = 0
  const store: IdempotencyStore = { ...inner, renew: async (lease, ms) => { renewals++; return inner.renew(lease, ms) } }
  const { app } = await setup(t, { store, lease: LEASE })
  const closed = deferred()
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    const run = ++runs
    if (run === 1) reply.raw.once('close', () => closed.resolve())
    await sleep(1500)
    return reply.code(201).send({ id: `ch_${run}` })
  })
  const port = await listen(app)

  const startedAt = Date.now()
  const client = rawPost(port, 'leave-1', '{"amount":100}')
  await sleep(200)
  client.abort()
  t.ok((await client.outcome).error, 'the client gave up')
  await closed.promise // the server saw the connection go

  await sleep(800 - (Date.now() - startedAt))
  const retry = await app.inject(pay('leave-1'))
  t.equal(retry.statusCode, 409, 'at 800 ms (2.7 leases) the retry gets 409: the owner still runs')
  t.equal((JSON.parse(retry.body) as { type: string }).type, PROBLEM_TYPE('request-in-progress'))
  await sleep(1200 - (Date.now() - startedAt))
  t.equal((await app.inject(pay('leave-1'))).statusCode, 409, 'and at 1.2 s (4 leases)')
  t.equal(runs, 1, 'no second execution')
  t.ok(renewals >= 3, `the owner kept renewing after its client left (${renewals} renewals)`)

  t.ok(await eventually(async () => (await inner.get({ scope: SCOPE, key: 'leave-1' }))?.state === 'completed'),
    'the handler finished and its response was recorded for the retry')
  const replay = await app.inject(pay('leave-1'))
  t.equal(replay.statusCode, 201)
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.same(replay.json(), { id: 'ch_1' }, 'the retry gets the one charge that was made')
  t.equal(runs, 1)
})

t.test('a retry with wait while a departed client\'s handler runs waits for its outcome and replays it', async (t) => {
  const { app } = await setup(t, { lease: 150, wait: 3000 })
  const gate = deferred()
  t.teardown(() => gate.resolve())
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    runs++
    await gate.promise
    return reply.code(201).send({ id: `ch_${runs}` })
  })
  const port = await listen(app)
  const client = rawPost(port, 'leave-wait', '{"amount":100}')
  await eventually(() => runs === 1)
  client.abort()
  await client.outcome
  const retry = app.inject(pay('leave-wait'))
  await sleep(600) // four leases: the original's renewals keep the key
  gate.resolve()
  const answer = await retry
  t.equal(answer.statusCode, 201)
  t.equal(answer.headers['idempotent-replayed'], 'true', 'the waiting retry got the recorded outcome')
  t.equal(runs, 1)
})

t.test('maxOwnership bounds a stuck owner: renewals stop after it, and a retry takes the key over once the lease lapses', async (t) => {
  const LEASE = 150
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  const completions: boolean[] = []
  const store: IdempotencyStore = {
    ...inner,
    complete: async (lease, response, ttl) => {
      const done = await inner.complete(lease, response, ttl)
      completions.push(done)
      return done
    }
  }
  const { app } = await setup(t, { store, lease: LEASE, maxOwnership: 300 })
  const hang = deferred()
  t.teardown(() => hang.resolve())
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    const run = ++runs
    if (run === 1) await hang.promise
    return reply.code(201).send({ id: `ch_${run}` })
  })
  const first = app.inject(pay('stuck-1'))
  await eventually(() => runs === 1)
  await sleep(200)
  t.equal((await app.inject(pay('stuck-1'))).statusCode, 409, 'within maxOwnership the live owner keeps its key')

  const lapsed = await eventually(async () => {
    const record: StoredRecord | null = await inner.get({ scope: SCOPE, key: 'stuck-1' })
    return record?.state === 'in_progress' && record.leaseRemainingMs === 0
  }, LEASE * 10)
  t.ok(lapsed, 'after maxOwnership the lease is no longer renewed and lapses')
  const retry = await app.inject(pay('stuck-1'))
  t.equal(retry.statusCode, 201, 'a retry takes the stuck key over')
  t.same(retry.json(), { id: 'ch_2' })
  t.equal(runs, 2)

  hang.resolve()
  t.equal((await first).statusCode, 201, 'the stuck owner still answers its own client')
  t.ok(await eventually(() => completions.length === 2, 1000))
  t.same(completions, [true, false], "the stuck owner's completion is fenced off")
  const replay = await app.inject(pay('stuck-1'))
  t.same(replay.json(), { id: 'ch_2' }, "the record is the new owner's")
})
