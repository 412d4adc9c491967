import type { FastifyServerOptions } from 'fastify'
import t, { type Test } from 'tap'
import { DEFAULT_REPLAY_HEADERS, memoryStore, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import { canonicalFingerprint } from '../../lib/core/fingerprint.js'
import type { StoredRecord } from '../../lib/core/store.js'
import { buildApp, keyed } from '../helpers/app.js'

/*
 * Behaviour 3 and 4 of the contract: the first request with a key runs the handler once and its
 * response is recorded; a retry with the same key and the same request gets that response
 * replayed (status, body bytes, replayable headers) with `Idempotent-Replayed: true`.
 */

const SCOPE = 'test'

/** A fresh app on a store the test can read, closed at teardown. */
async function setup (t: Test, plugin: IdempotencyOptions = {}, fastify?: FastifyServerOptions) {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store, ...plugin }, fastify })
  return { app, store }
}

function completed (t: Test, record: StoredRecord | null): Extract<StoredRecord, { state: 'completed' }> {
  if (record === null || record.state !== 'completed') {
    t.fail(`expected a completed record, got ${record === null ? 'null' : record.state}`)
    throw new Error('no completed record')
  }
  return record
}

t.test('the first request with a key runs the handler once and is answered unchanged, without Idempotent-Replayed', async (t) => {
  const { app, store } = await setup(t)
  let runs = 0
  app.post('/pay', async (request, reply) => {
    runs++
    reply.code(201).header('location', '/payments/pay_1')
    return { id: 'pay_1', amount: (request.body as { amount: number }).amount }
  })

  const res = await app.inject({ method: 'POST', url: '/pay', headers: keyed('first-1'), payload: { amount: 100 } })
  t.equal(runs, 1, 'the handler ran once')
  t.equal(res.statusCode, 201)
  t.same(res.json(), { id: 'pay_1', amount: 100 })
  t.equal(res.headers.location, '/payments/pay_1')
  t.match(res.headers['content-type'], /^application\/json/)
  t.equal(res.headers['idempotent-replayed'], undefined, 'the original never carries Idempotent-Replayed')

  const record = completed(t, await store.get({ scope: SCOPE, key: 'first-1' }))
  t.equal(record.response.statusCode, 201, 'the response was recorded')
  t.ok(record.response.body?.equals(res.rawPayload), 'the recorded body is the bytes the client got')
})

t.test('the same key and body after completion replays status, body bytes and headers; the handler does not run again', async (t) => {
  const { app } = await setup(t)
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    runs++
    reply.code(201).header('location', `/payments/pay_${runs}`)
    // Non-ASCII and escapes, so "byte for byte" means something.
    return { id: `pay_${runs}`, note: 'café ☕ "quoted" \\ 😀', amount: 100 }
  })

  const request = { method: 'POST' as const, url: '/pay', headers: keyed('replay-1'), payload: { amount: 100 } }
  const first = await app.inject(request)
  const replays = [await app.inject(request), await app.inject(request), await app.inject(request)]

  t.equal(runs, 1, 'the handler ran once for four requests')
  for (const [i, replay] of replays.entries()) {
    t.equal(replay.statusCode, 201, `replay ${i}: status`)
    t.ok(replay.rawPayload.equals(first.rawPayload), `replay ${i}: body byte for byte`)
    t.equal(replay.headers['content-type'], first.headers['content-type'], `replay ${i}: content-type`)
    t.equal(replay.headers.location, '/payments/pay_1', `replay ${i}: location`)
    t.equal(replay.headers['idempotent-replayed'], 'true', `replay ${i}: Idempotent-Replayed: true`)
    t.equal(replay.headers['content-length'], String(first.rawPayload.length), `replay ${i}: content-length matches the body`)
  }
})

t.test('every default replay header (Content-Type, Location, ETag, Link, ...) is replayed', async (t) => {
  const { app } = await setup(t)
  const sent: Record<string, string> = {
    'content-type': 'application/vnd.example+json; charset=utf-8',
    'content-language': 'fr',
    'content-disposition': 'inline; filename="receipt.json"',
    location: '/payments/pay_1',
    etag: '"v1-abc"',
    'last-modified': 'Wed, 21 Oct 2015 07:28:00 GMT',
    link: '</payments/pay_1/receipt>; rel="related"'
  }
  app.post('/pay', async (_request, reply) => {
    reply.code(201).headers(sent)
    return '{"id":"pay_1"}'
  })

  const request = { method: 'POST' as const, url: '/pay', headers: keyed('defaults-1'), payload: { amount: 1 } }
  const first = await app.inject(request)
  const replay = await app.inject(request)
  t.equal(replay.headers['idempotent-replayed'], 'true')
  for (const [name, value] of Object.entries(sent)) {
    t.ok(DEFAULT_REPLAY_HEADERS.includes(name), `${name} is a default replay header`)
    t.equal(first.headers[name], value, `${name} on the original`)
    t.equal(replay.headers[name], value, `${name} replayed`)
  }
  t.equal(replay.body, '{"id":"pay_1"}')
})

t.test('Set-Cookie, Date and headers outside the replay list are not replayed', async (t) => {
  const { app, store } = await setup(t)
  const ORIGINAL_DATE = 'Mon, 01 Jan 2001 00:00:00 GMT'
  app.post('/pay', async (_request, reply) => {
    reply.code(201)
      .header('set-cookie', 'session=secret-of-the-first-client; HttpOnly')
      .header('date', ORIGINAL_DATE)
      .header('x-request-id', 'req-original')
      .header('cache-control', 'private, max-age=60')
    return { id: 'pay_1' }
  })

  const request = { method: 'POST' as const, url: '/pay', headers: keyed('not-replayed-1'), payload: { amount: 1 } }
  const first = await app.inject(request)
  t.equal(first.headers['set-cookie'], 'session=secret-of-the-first-client; HttpOnly', 'the original has its cookie')
  t.equal(first.headers.date, ORIGINAL_DATE)
  t.equal(first.headers['x-request-id'], 'req-original')

  const replay = await app.inject(request)
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal(replay.headers['set-cookie'], undefined, 'Set-Cookie is never replayed')
  t.not(replay.headers.date, ORIGINAL_DATE, "the replay's Date is its own, not the original's")
  t.equal(replay.headers['x-request-id'], undefined, 'a custom header outside the list is not replayed')
  t.equal(replay.headers['cache-control'], undefined, 'Cache-Control is not in the default list')

  const record = completed(t, await store.get({ scope: SCOPE, key: 'not-replayed-1' }))
  t.same(Object.keys(record.response.headers).sort(), ['content-type'], 'only replayable headers are stored')
})

t.test('replayHeaders replays a custom header and nothing outside the list', async (t) => {
  const { app } = await setup(t, { replayHeaders: ['content-type', 'x-request-id'] })
  app.post('/pay', async (_request, reply) => {
    reply.code(201).header('x-request-id', 'req-original').header('location', '/payments/pay_1')
    return { id: 'pay_1' }
  })

  const request = { method: 'POST' as const, url: '/pay', headers: keyed('custom-headers-1'), payload: { amount: 1 } }
  const first = await app.inject(request)
  const replay = await app.inject(request)
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal(replay.headers['x-request-id'], 'req-original', 'the listed custom header is replayed')
  t.equal(replay.headers['content-type'], first.headers['content-type'])
  t.equal(replay.headers.location, undefined, 'Location is not replayed once the list no longer names it')
})

t.test("a handler's own 4xx is recorded and replayed (draft §2.6: success or error)", async (t) => {
  const { app, store } = await setup(t)
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    runs++
    return reply.code(402).send({ error: 'card_declined', attempt: runs })
  })

  const request = { method: 'POST' as const, url: '/pay', headers: keyed('declined-1'), payload: { amount: 1 } }
  const first = await app.inject(request)
  t.equal(first.statusCode, 402)
  t.equal(completed(t, await store.get({ scope: SCOPE, key: 'declined-1' })).response.statusCode, 402, 'the 402 is the recorded outcome')

  const replay = await app.inject(request)
  t.equal(runs, 1, 'the declined charge is not attempted again')
  t.equal(replay.statusCode, 402)
  t.same(replay.json(), { error: 'card_declined', attempt: 1 })
  t.equal(replay.headers['idempotent-replayed'], 'true')
})

t.test("a handler's own 409 business conflict is recorded and replayed, and is told apart from the plugin's 409", async (t) => {
  const { app } = await setup(t)
  let runs = 0
  app.post('/orders', async (_request, reply) => {
    runs++
    return reply.code(409).send({ error: 'order_already_shipped' })
  })

  const request = { method: 'POST' as const, url: '/orders', headers: keyed('conflict-1'), payload: { orderId: 7 } }
  const first = await app.inject(request)
  const replay = await app.inject(request)
  t.equal(runs, 1)
  t.equal(first.statusCode, 409)
  t.equal(replay.statusCode, 409)
  t.same(replay.json(), { error: 'order_already_shipped' })
  t.equal(replay.headers['idempotent-replayed'], 'true', 'a replayed 409, not an in-progress 409')
  t.match(replay.headers['content-type'], /^application\/json/, 'the handler’s content type, not application/problem+json')
  t.equal(replay.headers['retry-after'], undefined)
})

t.test('a 204 without a body replays as a 204 with an empty body', async (t) => {
  const { app, store } = await setup(t)
  let runs = 0
  app.post('/acks', async (_request, reply) => {
    runs++
    return reply.code(204).send()
  })

  const request = { method: 'POST' as const, url: '/acks', headers: keyed('no-content-1'), payload: { ok: true } }
  const first = await app.inject(request)
  t.equal(first.statusCode, 204)
  const record = completed(t, await store.get({ scope: SCOPE, key: 'no-content-1' }))
  t.equal(record.response.statusCode, 204)
  t.equal(record.response.body?.length, 0, 'an empty body is recorded (not "not retained")')

  const replay = await app.inject(request)
  t.equal(runs, 1)
  t.equal(replay.statusCode, 204)
  t.equal(replay.rawPayload.length, 0, 'no body')
  t.equal(replay.headers['content-type'], undefined, 'no content type invented for an empty body')
  t.equal(replay.headers['idempotent-replayed'], 'true')
})

t.test('PATCH is protected by default and replays', async (t) => {
  const { app } = await setup(t)
  let runs = 0
  app.patch('/accounts/:id', async (request) => {
    runs++
    return { id: (request.params as { id: string }).id, name: (request.body as { name: string }).name, version: runs }
  })

  const request = { method: 'PATCH' as const, url: '/accounts/a1', headers: keyed('patch-1'), payload: { name: 'Ada' } }
  const first = await app.inject(request)
  const replay = await app.inject(request)
  t.equal(runs, 1)
  t.equal(first.statusCode, 200)
  t.same(first.json(), { id: 'a1', name: 'Ada', version: 1 })
  t.equal(first.headers['idempotent-replayed'], undefined)
  t.equal(replay.statusCode, 200)
  t.ok(replay.rawPayload.equals(first.rawPayload))
  t.equal(replay.headers['idempotent-replayed'], 'true')
})

t.test("a replay passes through other plugins' onSend hooks and is never recorded again", async (t) => {
  const { app, store } = await setup(t)
  let onSendCalls = 0
  const seenReplayed: Array<boolean | undefined> = []
  app.addHook('onSend', async (request, reply, payload) => {
    onSendCalls++
    seenReplayed.push(request.idempotency?.replayed)
    reply.header('x-on-send', String(onSendCalls))
    return payload
  })
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    runs++
    reply.code(201).header('location', '/payments/pay_1').header('etag', '"e1"')
    return { id: 'pay_1' }
  })

  const request = { method: 'POST' as const, url: '/pay', headers: keyed('hooks-1'), payload: { amount: 1 } }
  const first = await app.inject(request)
  t.equal(first.headers['x-on-send'], '1')
  const original = completed(t, await store.get({ scope: SCOPE, key: 'hooks-1' }))

  for (let i = 2; i <= 4; i++) {
    const replay = await app.inject(request)
    t.equal(replay.headers['idempotent-replayed'], 'true', `replay ${i}`)
    t.equal(replay.headers['x-on-send'], String(i), `replay ${i} went through the other onSend hook`)
    t.ok(replay.rawPayload.equals(first.rawPayload), `replay ${i}: same body`)
  }
  t.equal(runs, 1)
  t.equal(onSendCalls, 4, 'the other hook ran once per response')
  t.same(seenReplayed, [false, true, true, true], 'request.idempotency.replayed tells the hook which responses were replays')

  const after = completed(t, await store.get({ scope: SCOPE, key: 'hooks-1' }))
  t.equal(after.response.statusCode, original.response.statusCode)
  t.same(after.response.headers, original.response.headers, 'headers unchanged by the replays')
  t.equal(after.response.headers['x-on-send'], undefined, 'a header added by a later hook is not replayable anyway')
  t.ok(after.response.body?.equals(original.response.body as Buffer), 'body unchanged by the replays')
})

t.test('the store records the outcome exactly once, however many replays follow', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  const calls = { claim: 0, complete: 0, release: 0 }
  const store: IdempotencyStore = {
    ...inner,
    claim: (request) => { calls.claim++; return inner.claim(request) },
    complete: (lease, response, ttl) => { calls.complete++; return inner.complete(lease, response, ttl) },
    release: (lease) => { calls.release++; return inner.release(lease) }
  }
  const { app } = await setup(t, { store })
  let runs = 0
  app.post('/pay', async (_request, reply) => {
    runs++
    return reply.code(201).send({ id: 'pay_1' })
  })

  const request = { method: 'POST' as const, url: '/pay', headers: keyed('once-1'), payload: { amount: 1 } }
  const N = 5
  await app.inject(request)
  for (let i = 0; i < N; i++) {
    const replay = await app.inject(request)
    t.equal(replay.headers['idempotent-replayed'], 'true')
  }
  t.equal(runs, 1)
  t.equal(calls.claim, N + 1, 'every request claimed')
  t.equal(calls.complete, 1, 'complete was called once, by the original')
  t.equal(calls.release, 0, 'nothing was released')
})

t.test('request.idempotency inside the handler describes the protected request', async (t) => {
  const { app } = await setup(t)
  let seen: unknown = 'not set'
  app.post('/pay', async (request) => {
    seen = request.idempotency
    return { ok: true }
  })

  const res = await app.inject({ method: 'POST', url: '/pay?currency=eur', headers: keyed('ctx-1'), payload: { amount: 100 } })
  t.equal(res.statusCode, 200)
  t.match(seen, {
    key: 'ctx-1',
    scope: SCOPE,
    fingerprint: { algorithm: 'canonical-v1', digest: Buffer },
    replayed: false
  })
  const context = seen as { fingerprint: { digest: Buffer } }
  t.ok(Buffer.isBuffer(context.fingerprint.digest))
  t.equal(context.fingerprint.digest.length, 32, 'a SHA-256 digest')
  const expected = canonicalFingerprint('POST', '/pay?currency=eur', { amount: 100 })
  t.ok(context.fingerprint.digest.equals(expected.digest), 'the canonical fingerprint of method, target and body')
})

t.test('request.idempotency is the unquoted key of a bare (lenient) key too', async (t) => {
  const { app } = await setup(t)
  let key: string | undefined
  app.post('/pay', async (request) => {
    key = request.idempotency?.key
    return { ok: true }
  })
  await app.inject({
    method: 'POST',
    url: '/pay',
    headers: { 'idempotency-key': '8e03978e-40d5-43e8-bc93-6894a57f9324', 'content-type': 'application/json' },
    payload: { amount: 1 }
  })
  t.equal(key, '8e03978e-40d5-43e8-bc93-6894a57f9324')
})

t.test('request.idempotency is null on an unprotected GET, and on a POST without a key', async (t) => {
  const { app } = await setup(t)
  const seen: unknown[] = []
  app.get('/pay', async (request) => {
    seen.push(request.idempotency)
    return { ok: true }
  })
  app.post('/pay', async (request) => {
    seen.push(request.idempotency)
    return { ok: true }
  })

  const get = await app.inject({ method: 'GET', url: '/pay', headers: { 'idempotency-key': '"get-1"' } })
  const post = await app.inject({ method: 'POST', url: '/pay', payload: { amount: 1 } })
  t.equal(get.statusCode, 200)
  t.equal(post.statusCode, 200)
  t.same(seen, [null, null])
  t.equal(get.headers['idempotent-replayed'], undefined)
})
