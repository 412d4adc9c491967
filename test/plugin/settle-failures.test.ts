import http from 'node:http'
import type { AddressInfo } from 'node:net'
import { Readable, Writable } from 'node:stream'
import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import { buildApp, deferred, eventually, keyed, PROBLEM_TYPE } from '../helpers/app.js'
import { sleep } from '../helpers/sleep.js'

/*
 * What happens to a key when settling its answer goes wrong (cases 6, 12, 13, 14, 15),
 * and when an answer interrupts a handler that still runs. The key is never stranded in progress,
 * an answer that cannot be sent is never recorded, a bug in a route gets the answer it gets
 * without the plugin, and every decision logged is the one the store made.
 */

const SCOPE = 'test'

async function listen (app: FastifyInstance): Promise<number> {
  await app.listen({ host: '127.0.0.1', port: 0 })
  return (app.server.address() as AddressInfo).port
}

interface Answer { status: number | null, body: string, headers: http.IncomingHttpHeaders, error: string | null }

/** One POST over a real socket (light-my-request does not call Node's writeHead checks the same way). */
function send (port: number, path: string, key: string, timeoutMs = 3000): Promise<Answer> {
  return new Promise((resolve) => {
    const req = http.request({ host: '127.0.0.1', port, method: 'POST', path, agent: false, headers: keyed(key) }, (res) => {
      let body = ''
      res.setEncoding('utf8')
      res.on('data', (chunk: string) => { body += chunk })
      res.on('end', () => resolve({ status: res.statusCode ?? null, body, headers: res.headers, error: null }))
    })
    req.on('error', (err) => resolve({ status: null, body: '', headers: {}, error: err.message }))
    req.setTimeout(timeoutMs, () => { req.destroy(new Error('timeout')) })
    req.end('{"amount":1}')
  })
}

/** Logged lines (pino JSON) of an app, for the decisions it reports. */
function logLines (): { stream: Writable, lines: Array<{ msg: string, idempotency?: { outcome: string } }> } {
  const lines: Array<{ msg: string, idempotency?: { outcome: string } }> = []
  const stream = new Writable({
    write (chunk: Buffer, _encoding, callback) {
      for (const line of chunk.toString().split('\n')) if (line !== '') lines.push(JSON.parse(line))
      callback()
    }
  })
  return { stream, lines }
}

const outcomes = (lines: ReturnType<typeof logLines>['lines']): string[] =>
  lines.flatMap((line) => line.idempotency?.outcome === undefined ? [] : [line.idempotency.outcome])

t.test('case 6: a record rule that throws records the answer the client got; the retry replays it, the handler ran once', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const log = logLines()
  const app = await buildApp(t, {
    plugin: { store, lease: 100, record: () => { throw new Error('record rule bug') } },
    fastify: { logger: { level: 'info', stream: log.stream } }
  })
  let runs = 0
  app.post('/pay', async (_request, reply) => reply.code(201).send({ id: `ch_${++runs}` }))

  const first = await app.inject({ method: 'POST', url: '/pay', headers: keyed('rule'), payload: {} })
  t.equal(first.statusCode, 201, 'the handler\'s answer goes out')
  t.equal((await store.get({ scope: SCOPE, key: 'rule' }))?.state, 'completed', 'and is recorded: the key is not released after its effect')
  t.ok(outcomes(log.lines).includes('settle_failed'), 'the rule\'s error is logged')
  await sleep(150)
  const retry = await app.inject({ method: 'POST', url: '/pay', headers: keyed('rule'), payload: {} })
  t.equal(retry.statusCode, 201)
  t.equal(retry.headers['idempotent-replayed'], 'true', 'the retry, after the lease, replays the first answer')
  t.equal(retry.body, first.body)
  t.equal(runs, 1, 'the handler ran once')
})

t.test('case 12: an endless stream whose client left, once over maxResponseBytes, is destroyed and settled as not retained', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store, maxResponseBytes: 64 * 1024 } })
  let runs = 0
  const stopped = deferred()
  app.post('/endless', async (_request, reply) => {
    runs++
    reply.type('application/octet-stream')
    const chunk = Buffer.alloc(16 * 1024, 1)
    async function * forever (): AsyncGenerator<Buffer> {
      try {
        for (;;) {
          await sleep(1)
          yield chunk
        }
      } finally {
        stopped.resolve()
      }
    }
    return Readable.from(forever())
  })
  const port = await listen(app)
  await new Promise<void>((resolve) => {
    const req = http.request({ host: '127.0.0.1', port, method: 'POST', path: '/endless', agent: false, headers: keyed('endless') }, (res) => {
      res.once('data', () => { req.destroy(); resolve() })
    })
    req.on('error', () => {})
    req.end('{}')
  })
  t.ok(await eventually(async () => { await Promise.race([stopped.promise, sleep(10)]); return (await store.get({ scope: SCOPE, key: 'endless' }))?.state === 'completed' }),
    'the key was settled')
  await stopped.promise
  t.pass('the source was destroyed (its generator finished)')
  const retry = await app.inject({ method: 'POST', url: '/endless', headers: keyed('endless'), payload: {} })
  t.equal(retry.statusCode, 410, 'completed, not retained: never executed again')
  t.equal(JSON.parse(retry.body).type, PROBLEM_TYPE('response-not-retained'))
  t.equal(runs, 1)
})

t.test('case 13: an async handler that calls reply.send() without returning reply behaves as without the plugin, and is recorded', async (t) => {
  const rejections: unknown[] = []
  const onRejection = (reason: unknown): void => { rejections.push(reason) }
  process.on('unhandledRejection', onRejection)
  t.teardown(() => { process.off('unhandledRejection', onRejection) })
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store } })
  let runs = 0
  app.post('/no-content', async (_request, reply) => { runs++; reply.code(204).send() })
  app.post('/json', async (_request, reply) => { runs++; reply.code(201).send({ id: 'ch_1' }) })
  const port = await listen(app)

  for (const [path, status, body] of [['/no-content', 204, ''], ['/json', 201, '{"id":"ch_1"}']] as const) {
    runs = 0
    const first = await send(port, path, `send-${path}`)
    t.equal(first.status, status, `${path}: the original answer`)
    t.equal(first.body, body)
    const replay = await send(port, path, `send-${path}`)
    t.equal(replay.status, status, `${path}: replayed`)
    t.equal(replay.body, body)
    t.equal(replay.headers['idempotent-replayed'], 'true')
    t.equal(runs, 1, `${path}: the handler ran once`)
    const injected = await app.inject({ method: 'POST', url: path, headers: keyed(`inject-${path}`), payload: {} })
    t.equal(injected.statusCode, status, `${path}: the same through inject`)
  }
  await sleep(50)
  t.same(rejections, [], 'no ERR_HTTP_HEADERS_SENT (nor any other unhandled rejection)')
})

t.test('case 14: an answer Node or Fastify refuses gets the same 500 as without the plugin, is never recorded, the key is held (the handler returned: its effect may have happened), and the process keeps serving', async (t) => {
  const rejections: unknown[] = []
  const onRejection = (reason: unknown): void => { rejections.push(reason) }
  process.on('unhandledRejection', onRejection)
  t.teardown(() => { process.off('unhandledRejection', onRejection) })

  const runs = new Map<string, number>()
  const routes = (app: FastifyInstance): void => {
    const count = (path: string): void => { runs.set(path, (runs.get(path) ?? 0) + 1) }
    app.post('/crlf', async (_request, reply) => { count('/crlf'); reply.header('content-disposition', 'attachment; filename="a\r\nb.txt"'); return { ok: 1 } })
    app.post('/latin1', async (_request, reply) => { count('/latin1'); reply.header('content-disposition', 'attachment; filename="€.txt"'); return { ok: 1 } })
    app.post('/name', async (request, reply) => { count('/name'); reply.header(String(request.headers['x-name'] ?? 'x bad'), 'v'); return { ok: 1 } })
    app.post('/payload', async (_request, reply) => { count('/payload'); reply.type('application/json').serializer(() => 42 as unknown as string); return { ok: 1 } })
  }
  const plain = Fastify()
  t.teardown(() => plain.close())
  routes(plain)
  const plainPort = await listen(plain)
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: () => SCOPE })
  routes(app)
  app.post('/fine', async () => ({ fine: true }))
  const port = await listen(app)

  for (const path of ['/crlf', '/latin1', '/name', '/payload']) {
    const expected = await send(plainPort, path, 'plain')
    runs.clear()
    const first = await send(port, path, `bad-${path}`)
    t.equal(first.status, 500, `${path}: a 500`)
    t.equal(first.body, expected.body, `${path}: the very answer Fastify gives without the plugin`)
    await eventually(async () => (await store.inspect({ scope: SCOPE, key: `bad-${path}` }))?.indeterminate === true)
    t.match(await store.inspect({ scope: SCOPE, key: `bad-${path}` }), { state: 'in_progress', indeterminate: true, response: null },
      `${path}: nothing recorded; the key is held for the reconciler, not released`)
    const retry = await send(port, path, `bad-${path}`)
    t.equal(retry.status, 409, `${path}: the retry is refused while the key is held`)
    t.equal(runs.get(path), 1, `${path}: the route ran once`)
  }
  t.match(await send(port, '/fine', 'fine'), { status: 200, body: '{"fine":true}' }, 'the process keeps serving')
  await sleep(50)
  t.same(rejections, [], 'no unhandled rejection')
})

t.test('case 15: logs report what the store did', async (t) => {
  t.test('a release the store refused (the key changed hands) is not logged as a release', async (t) => {
    const inner = memoryStore({ purgeInterval: 0 })
    t.teardown(() => inner.close())
    const log = logLines()
    const store: IdempotencyStore = { ...inner, release: async () => false }
    const app = await buildApp(t, { plugin: { store }, fastify: { logger: { level: 'debug', stream: log.stream } } })
    app.post('/pay', async () => { throw new Error('failed') })
    await app.inject({ method: 'POST', url: '/pay', headers: keyed('refused'), payload: {} })
    t.notOk(outcomes(log.lines).includes('released'), 'no "released"')
    t.ok(outcomes(log.lines).includes('lease_lost'), 'the refusal is what is logged')
  })

  t.test('a late claim that can no longer be released is not logged as released', async (t) => {
    const inner = memoryStore({ purgeInterval: 0 })
    t.teardown(() => inner.close())
    const log = logLines()
    const released = deferred()
    const store: IdempotencyStore = {
      ...inner,
      claim: async (request) => { await sleep(150); return await inner.claim(request) },
      release: async () => { released.resolve(); return false }
    }
    const app = await buildApp(t, { plugin: { store, storeTimeout: 20 }, fastify: { logger: { level: 'debug', stream: log.stream } } })
    app.post('/pay', async () => ({ ok: true }))
    t.equal((await app.inject({ method: 'POST', url: '/pay', headers: keyed('late'), payload: {} })).statusCode, 503)
    await released.promise
    await sleep(10)
    t.notOk(outcomes(log.lines).includes('released'))
    t.ok(outcomes(log.lines).includes('lease_lost'))
  })

  t.test('a renewal that races the completion does not report the lease lost', async (t) => {
    const inner = memoryStore({ purgeInterval: 0 })
    t.teardown(() => inner.close())
    const log = logLines()
    const store: IdempotencyStore = {
      ...inner,
      // A renewal sent just before the completion lands just after it: the store says "not yours".
      renew: async (lease, ms) => { await sleep(40); return await inner.renew(lease, ms) },
      complete: async (lease, response, ttl) => { await sleep(25); return await inner.complete(lease, response, ttl) }
    }
    const app = await buildApp(t, { plugin: { store, lease: 30 }, fastify: { logger: { level: 'debug', stream: log.stream } } })
    app.post('/pay', async () => { await sleep(12); return { ok: true } })
    for (let i = 0; i < 5; i++) await app.inject({ method: 'POST', url: '/pay', headers: keyed(`race-${i}`), payload: {} })
    await sleep(100)
    t.equal(outcomes(log.lines).filter((outcome) => outcome === 'recorded').length, 5, 'every response was recorded')
    t.notOk(outcomes(log.lines).includes('lease_lost'), 'and no lease was reported lost')
  })

  t.test('the reconciler counts a resolution the store refused as lost, not as done', async (t) => {
    const store = memoryStore({ purgeInterval: 0 })
    t.teardown(() => store.close())
    const app = await buildApp(t, { plugin: { store } })
    app.post('/pay', async (request) => {
      request.idempotency?.markIndeterminate()
      throw new Error('unsure')
    })
    await app.inject({ method: 'POST', url: '/pay', headers: keyed('reconcile'), payload: {} })
    const report = await store.reconcile({
      olderThan: 0,
      resolve: async (record) => {
        await store.forceRelease(record) // an operator acts while resolve runs
        return { action: 'complete', response: { statusCode: 201, body: { ok: true } } }
      }
    })
    t.match(report, { examined: 1, completed: 0, lost: 1 })
  })
})

t.test('an answer that interrupts a running handler (handlerTimeout): the key stays held until it returns', async (t) => {
  async function world (t: Test, options: IdempotencyOptions = {}) {
    const store = memoryStore({ purgeInterval: 0 })
    t.teardown(() => store.close())
    const app = await buildApp(t, { plugin: { store, lease: 150, ...options }, fastify: { handlerTimeout: 200 } })
    return { app, store }
  }

  t.test('a handler that completes after its timeout answer: no retry runs beside it, and the key is held (indeterminate)', async (t) => {
    const { app, store } = await world(t)
    let runs = 0
    let completed = false
    app.post('/slow', async (_request, reply) => {
      runs++
      await sleep(800)
      completed = true
      return reply.code(201).send({ id: 'ch_1' })
    })
    const first = await app.inject({ method: 'POST', url: '/slow', headers: keyed('timeout'), payload: {} })
    t.equal(first.statusCode, 503, 'Fastify answered the timeout')
    await sleep(200)
    t.equal((await app.inject({ method: 'POST', url: '/slow', headers: keyed('timeout'), payload: {} })).statusCode, 409,
      'a retry while the handler still runs gets 409 (2.7 leases after the answer)')
    t.equal(runs, 1)
    t.ok(await eventually(() => completed))
    t.ok(await eventually(async () => (await store.inspect({ scope: SCOPE, key: 'timeout' }))?.indeterminate === true),
      'the handler completed after the client was told it failed: held for the reconciler')
    t.equal((await app.inject({ method: 'POST', url: '/slow', headers: keyed('timeout'), payload: {} })).statusCode, 409)
    t.equal(runs, 1, 'never run twice')
  })

  t.test('a handler that gives up on its signal fails definitely: the key is released once it returned', async (t) => {
    const { app, store } = await world(t)
    let runs = 0
    app.post('/cooperative', async (request, reply) => {
      const run = ++runs
      if (run === 1) {
        await new Promise((resolve) => request.signal.addEventListener('abort', resolve))
        await sleep(300) // cleans up for a while after the abort
        throw new Error('aborted')
      }
      return reply.code(201).send({ id: `ch_${run}` })
    })
    t.equal((await app.inject({ method: 'POST', url: '/cooperative', headers: keyed('signal'), payload: {} })).statusCode, 503)
    t.equal((await app.inject({ method: 'POST', url: '/cooperative', headers: keyed('signal'), payload: {} })).statusCode, 409,
      'while it cleans up, the key is still held')
    t.ok(await eventually(async () => (await store.get({ scope: SCOPE, key: 'signal' })) === null), 'released once the handler threw')
    const retry = await app.inject({ method: 'POST', url: '/cooperative', headers: keyed('signal'), payload: {} })
    t.equal(retry.statusCode, 201, 'the retry runs the operation')
    t.equal(runs, 2)
  })
})
