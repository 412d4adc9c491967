import { gzipSync } from 'node:zlib'
import t from 'tap'
import { createIdempotentClient, ResponseTooLargeError, type IdempotentClientOptions } from '../../client/index.js'
import { buildApp } from '../helpers/app.js'
import { bigAnswer, bystander, countingFetch, MiB, serve, type Sent } from '../helpers/http-recorder.js'

/*
 * The client's security options: `redirect: 'same-origin'` (follows redirects within the request's
 * origin only, never re-sending the body or the key to a GET), `maxResponseBytes` (its edges, a
 * decompression bomb, HEAD), and `ResponseTooLargeError` (not retried unless the status is, and
 * the key kept so that the answer can still be fetched, replayed, with a larger limit).
 */

const SECRET = 'sk_live_do_not_leak'
const CARD = '4242424242424242'

t.test('redirect: \'same-origin\' follows only within the origin: 307/308 repeat the operation; 303 and 301/302 to a POST become a bodiless, keyless GET', async (t) => {
  const other = await bystander(t)
  const api = await serve(t, (request, response) => {
    const [, route, status] = request.url.split('/')
    const locations: Record<string, string> = {
      here: '/landing',
      away: `${other.origin}/collect`,
      scheme: `https://127.0.0.1:${api.port}/landing`,
      userinfo: `http://user:pw@127.0.0.1:${api.port}/landing`,
      hop: `/away/${status ?? ''}`
    }
    if (route === 'landing' || route === undefined || !(route in locations)) {
      response.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({
        method: request.method,
        url: request.url,
        key: request.headers['idempotency-key'] ?? null,
        apiKey: request.headers['x-api-key'] ?? null,
        contentType: request.headers['content-type'] ?? null,
        body: request.body
      }))
      return
    }
    response.writeHead(Number(status), { location: locations[route] ?? '' }).end()
  })
  const client = createIdempotentClient({ baseUrl: api.origin, redirect: 'same-origin', headers: { 'x-api-key': SECRET } })
  const body = { card: CARD }

  for (const status of [307, 308]) {
    const result = await client.post(`/here/${status}`, { body })
    t.same([result.status, result.attempts, result.json()], [200, 1, {
      method: 'POST', url: '/landing', key: `"${result.key ?? ''}"`, apiKey: SECRET, contentType: 'application/json', body: JSON.stringify(body)
    }], `${status}: the same operation, its key and body included, at the new location on the same origin`)
  }
  for (const status of [301, 302, 303]) {
    const result = await client.post(`/here/${status}`, { body })
    t.same([result.status, result.json()], [200, { method: 'GET', url: '/landing', key: null, apiKey: SECRET, contentType: null, body: '' }],
      `${status}: a GET without the body, its content type or the key (credentials stay: same origin)`)
    t.ok(result.key, `${status}: the result still names the operation's key`)
  }
  const put = await client.put('/here/301', { body })
  t.same(put.json(), { method: 'PUT', url: '/landing', key: null, apiKey: SECRET, contentType: 'application/json', body: JSON.stringify(body) },
    '301 to a PUT repeats the PUT (Fetch Standard: only a POST becomes a GET)')

  for (const status of [301, 302, 303, 307, 308]) {
    const away = await client.post(`/away/${status}`, { body })
    t.same([away.status, away.headers.get('location')], [status, `${other.origin}/collect`], `${status} to another origin: returned, not followed`)
    const chained = await client.post(`/hop/${status}`, { body })
    t.same([chained.status, chained.headers.get('location')], [status, `${other.origin}/collect`], `${status}: a same-origin hop, then another origin: the second 3xx is the answer`)
  }
  const scheme = await client.post('/scheme/307', { body })
  t.equal(scheme.status, 307, 'http → https is another origin: returned, not followed')
  const userinfo = await client.post('/userinfo/307', { body })
  t.same([userinfo.status, userinfo.attempts], [307, 1], 'a Location with credentials in it: returned, not followed (and not retried as a fetch error)')
  t.same(other.received, [], 'the other origin received no request at all')
})

t.test('redirect: \'same-origin\' gives up after 5 hops and returns the last 3xx', async (t) => {
  const api = await serve(t, (_request, response) => { response.writeHead(308, { location: '/loop' }).end() })
  const client = createIdempotentClient({ baseUrl: api.origin, redirect: 'same-origin' })
  const result = await client.post('/loop', { body: {} })
  t.same([result.status, result.attempts], [308, 1])
  t.equal(api.received.length, 6, 'the request and 5 redirects')
  t.same(new Set(api.received.map((r) => r.headers['idempotency-key'])), new Set([`"${result.key ?? ''}"`]), 'each hop of a 308 carries the operation\'s key')
})

t.test('the redirect option is validated: fetch\'s \'follow\' and anything else are refused by name', async (t) => {
  for (const value of ['follow', 'error', 'same-site', true, 0]) {
    t.throws(() => createIdempotentClient({ redirect: value as unknown as 'manual' }),
      { name: 'InvalidOptionError', option: 'redirect', message: /redirect must be 'manual' or 'same-origin'.*; received/ }, `${String(value)} is refused`)
  }
  t.ok(createIdempotentClient({ redirect: 'manual' }) && createIdempotentClient({ redirect: 'same-origin' }), 'the two modes are accepted')
})

t.test('maxResponseBytes: exactly the limit is read; one byte more is refused; gzip is counted decoded; HEAD has no body', async (t) => {
  const limit = 64 * 1024
  const sent: Sent = { written: 0, finished: false, closed: false }
  const bomb = gzipSync(Buffer.alloc(32 * MiB))
  const api = await serve(t, (request, response) => {
    const [, route, size] = request.url.split('/')
    const bytes = Number(size)
    if (route === 'cl') response.writeHead(200, { 'content-length': String(bytes) }).end(Buffer.alloc(bytes, 0x62))
    else if (route === 'chunked') { response.writeHead(200); response.write(Buffer.alloc(bytes - 1, 0x62)); response.end(Buffer.alloc(1, 0x62)) } else if (route === 'gzip') response.writeHead(200, { 'content-encoding': 'gzip', 'content-length': String(bomb.length) }).end(bomb)
    else bigAnswer(response, 64 * MiB, 'content-length', sent)
  })
  const { fetch, pulled } = countingFetch()
  const client = createIdempotentClient({ baseUrl: api.origin, fetch, maxResponseBytes: limit })

  for (const framing of ['cl', 'chunked']) {
    const whole = await client.post(`/${framing}/${limit}`, { body: {} })
    t.same([whole.status, whole.body.byteLength, whole.body.every((b) => b === 0x62)], [200, limit, true], `${framing}: ${limit} bytes, read whole`)
    await t.rejects(client.post(`/${framing}/${limit + 1}`, { body: {} }), { name: 'ResponseTooLargeError', limit, declaredBytes: framing === 'cl' ? limit + 1 : null },
      `${framing}: ${limit + 1} bytes are refused`)
  }

  pulled.bytes = 0
  pulled.largestChunk = 0
  const bombed = await client.post('/gzip', { body: {} }).then(() => null, (err: unknown) => err)
  t.ok(bombed instanceof ResponseTooLargeError && bombed.declaredBytes === null, `a ${bomb.length}-byte gzip of 32 MiB: refused by counting (the Content-Length counts coded bytes)`)
  t.ok(pulled.bytes <= limit + pulled.largestChunk, `${pulled.bytes} decoded bytes taken, at most the limit plus one chunk (${pulled.largestChunk})`)

  const head = await client.request('HEAD', '/big')
  t.same([head.status, head.headers.get('content-length'), head.body.byteLength], [200, String(64 * MiB), 0], 'a HEAD answer\'s Content-Length is not a body')

  const zero = createIdempotentClient({ baseUrl: api.origin, maxResponseBytes: 0 })
  t.equal((await zero.post('/cl/0', { body: {} })).status, 200, 'maxResponseBytes: 0 still takes an empty body')
  await t.rejects(zero.post('/cl/1', { body: {} }), { name: 'ResponseTooLargeError' }, 'and refuses one byte')
})

t.test('a too-large answer whose status is retried anyway (503) is retried; a replayed one is final', async (t) => {
  let calls = 0
  const api = await serve(t, (_request, response) => {
    calls++
    if (calls === 1) response.writeHead(503, { 'content-length': String(4 * MiB) }).end(Buffer.alloc(4 * MiB))
    else if (calls === 2) response.writeHead(201, { 'content-type': 'application/json' }).end('{"ok":true}')
    else response.writeHead(201, { 'idempotent-replayed': 'true', 'content-length': String(4 * MiB) }).end(Buffer.alloc(4 * MiB))
  })
  const client = createIdempotentClient({ baseUrl: api.origin, maxResponseBytes: MiB, sleep: async () => {} })
  const retried = await client.post('/pay', { body: {} })
  t.same([retried.status, retried.attempts, retried.json()], [201, 2, { ok: true }], 'the oversized 503 was retried like any 503')
  const replayed = await client.post('/pay', { body: {} }).then(() => null, (err: unknown) => err)
  t.ok(replayed instanceof ResponseTooLargeError && replayed.replayed && replayed.status === 201 && replayed.attempts === 1,
    'an oversized replay is thrown at once: asking again would replay the same bytes')
})

t.test('an answer too large for the client is not lost: its key, sent again with a larger limit, replays it without a second execution', async (t) => {
  const app = await buildApp(t, { plugin: { maxResponseBytes: 4 * MiB }, fastify: { forceCloseConnections: true } })
  let runs = 0
  app.post('/report', async (_request, reply) => {
    runs++
    return reply.code(201).type('application/octet-stream').send(Buffer.alloc(2 * MiB, 0x63))
  })
  await app.listen({ host: '127.0.0.1', port: 0 })
  const address = app.server.address()
  const baseUrl = `http://127.0.0.1:${typeof address === 'object' && address !== null ? address.port : 0}`

  const small: IdempotentClientOptions = { baseUrl, maxResponseBytes: MiB }
  const error = await createIdempotentClient(small).post('/report', { body: { month: 11 } }).then(() => null, (err: unknown) => err)
  t.ok(error instanceof ResponseTooLargeError && error.status === 201 && error.key !== null, `201, refused by the client (${String(error)})`)
  const key = error instanceof ResponseTooLargeError ? error.key ?? undefined : undefined
  const again = await createIdempotentClient({ baseUrl, maxResponseBytes: 4 * MiB }).post('/report', { body: { month: 11 }, key })
  t.same([again.status, again.replayed, again.body.byteLength, runs], [201, true, 2 * MiB, 1], 'the recorded answer, replayed; the handler ran once')
})

t.test('maxResponseBytes is validated once, naming the option and the value', async (t) => {
  for (const value of [-1, 1.5, '8MiB', 2 ** 31, Number.POSITIVE_INFINITY]) {
    t.throws(() => createIdempotentClient({ maxResponseBytes: value as number }),
      { name: 'InvalidOptionError', option: 'maxResponseBytes', message: /maxResponseBytes must be an integer from 0 to 2147483647; received/ }, `${String(value)} is refused`)
  }
})
