import t from 'tap'
import { createIdempotentClient, InvalidOptionError } from '../../client/index.js'
import { eventually } from '../helpers/app.js'
import { bigAnswer, bystander, countingFetch, MiB, serve, type Received, type Sent } from '../helpers/http-recorder.js'

/*
 * What the client does by default with a hostile or careless server, or a path taken from input:
 * a 3xx is the answer (never followed, so nothing reaches an origin the caller did not name), a
 * path that resolves outside `baseUrl` is refused before any request, and no answer makes the
 * client take more than `maxResponseBytes` (8 MiB) plus one chunk. Real HTTP servers on loopback
 * record every request they receive. The opt-ins (same-origin redirects, another limit) and the
 * error type are in security-options.test.ts.
 */

const SECRET = 'sk_live_do_not_leak'
const CARD = '4242424242424242'

/** What a request that should not have been sent gave away, for the failure's diagnostic. */
const leaked = (request: Received): object => ({
  method: request.method, url: request.url, key: request.headers['idempotency-key'], apiKey: request.headers['x-api-key'], body: request.body
})

t.test('by default a 3xx is the answer: a 301/302/303/307/308 to another origin sends it nothing (no body, key or x-api-key)', async (t) => {
  const other = await bystander(t)
  const api = await serve(t, (request, response) => {
    const status = Number(request.url.split('/').pop())
    response.writeHead(status, { location: `${other.origin}/collect` }).end('moved')
  })
  const client = createIdempotentClient({ baseUrl: api.origin, headers: { 'x-api-key': SECRET } })

  for (const status of [301, 302, 303, 307, 308]) {
    const result = await client.post(`/pay/${status}`, { body: { card: CARD } })
    t.same([result.status, result.headers.get('location'), result.text(), result.attempts], [status, `${other.origin}/collect`, 'moved', 1],
      `${status}: returned as the answer, with its Location, after one attempt`)
    const sent = api.received.at(-1)
    t.same([sent?.headers['idempotency-key'], sent?.headers['x-api-key'], sent?.body], [`"${result.key ?? ''}"`, SECRET, JSON.stringify({ card: CARD })],
      `${status}: the API itself got the operation`)
  }
  t.same(other.received.map(leaked), [], 'the other origin received no request at all')
  t.equal(api.received.length, 5, 'one request per call: a 3xx is final, not retried')
})

t.test('paths that resolve outside baseUrl are refused before anything is sent: 0 requests anywhere', async (t) => {
  const other = await bystander(t)
  const api = await serve(t, (_request, response) => { response.end('ok') })
  const host = `127.0.0.1:${other.port}`
  const client = createIdempotentClient({ baseUrl: `${api.origin}/api/v1`, headers: { 'x-api-key': SECRET }, maxAttempts: 1 })

  const escaping: Array<string | URL> = [
    // scheme-relative and backslash forms: another host to a WHATWG parser
    `//${host}/x`, `///${host}/x`, `////${host}/x`, `/\\${host}/x`, `\\${host}/x`, `\\\\${host}/x`, `\\/${host}/x`, `/\\/${host}/x`,
    // characters the parser strips, turning the text into one of the above
    `/\t/${host}/x`, `\t//${host}/x`, `/\n/${host}/x`, `/\r\n/${host}/x`, ` //${host}/x`, `//${host}/x `,
    // absolute URLs of another origin (host, port or scheme)
    `http://${host}/x`, `HTTP://${host}/x`, `https:${host}/x`, `https:\\\\${host}/x`, new URL(`http://${host}/x`),
    `${api.origin.replace('http:', 'https:')}/api/v1/x`,
    // the same origin, outside the path prefix
    new URL(`${api.origin}/admin`), `${api.origin}/api/v2/x`, `${api.origin}/api/v1/../../admin`, `${api.origin}/api/v1x`,
    '..', '/..', '../x', '/../x', '/../../x', './../x', '/orders/../../x', '/orders/../../../v2/x',
    // percent-encoded dot segments (the parser resolves them) and encoded separators (a decoding server would)
    '%2e%2e/x', '/%2E%2E/x', '.%2e/x', '%2e./x', '/%2e%2e', '/..%2fadmin', '/orders/..%2F..%2Fadmin', '/..%5cadmin', '/%2e%2e%2fadmin', '/x/.%2E%5C..%5Cadmin'
  ]
  for (const path of escaping) {
    const error = await client.post(path, { body: { card: CARD } }).then(() => null, (err: unknown) => err)
    t.ok(error instanceof InvalidOptionError && error.option === 'path' && /path must be/.test(error.message),
      `${JSON.stringify(String(path))} is refused as a path (${String(error)})`)
  }
  t.same(api.received.map(leaked), [], 'the API received nothing')
  t.same(other.received.map(leaked), [], 'the other origin received nothing')

  const inside: Array<[string | URL, string]> = [
    ['/orders', '/api/v1/orders'], ['orders', '/api/v1/orders'], ['/orders/../items', '/api/v1/items'], ['/a/./b', '/api/v1/a/b'],
    ['/files/a%2Fb', '/api/v1/files/a%2Fb'], ['/v%2e1', '/api/v1/v%2e1'], ['?page=2', '/api/v1/?page=2'], ['/@evil.example', '/api/v1/@evil.example'],
    [`${api.origin}/api/v1/orders`, '/api/v1/orders'], [new URL(`${api.origin}/api/v1/orders`), '/api/v1/orders']
  ]
  for (const [path, url] of inside) {
    const result = await client.post(path, { body: {} })
    t.same([result.status, api.received.at(-1)?.url], [200, url], `${String(path)} stays inside: ${url}`)
  }
  t.same(other.received.map(leaked), [], 'still nothing on the other origin')
})

t.test('by default (8 MiB) a 64 MiB answer is cut off: chunked, counted as it arrives; with Content-Length, before the first byte', async (t) => {
  const total = 64 * MiB
  const limit = 8 * MiB
  for (const framing of ['chunked', 'content-length'] as const) {
    const sent: Sent = { written: 0, finished: false, closed: false }
    const api = await serve(t, (_request, response) => { bigAnswer(response, total, framing, sent) })
    const { fetch, pulled } = countingFetch()
    const client = createIdempotentClient({ baseUrl: api.origin, fetch })

    const error = await client.post('/export', { body: { all: true } }).then(() => null, (err: unknown) => err)

    // Checked by its public fields rather than the class, so that this file also runs against a
    // client from before the limit existed (where the call resolves with the whole answer).
    t.match(error, { name: 'ResponseTooLargeError', code: 'IDEMPOTENCY_CLIENT_RESPONSE_TOO_LARGE', status: 200, attempts: 1, limit },
      `${framing}: rejects with ResponseTooLargeError: the status, the limit; not retried (${String(error)})`)
    if (framing === 'chunked') {
      t.ok(pulled.bytes > limit && pulled.bytes <= limit + pulled.largestChunk,
        `${framing}: the client took ${pulled.bytes} bytes: past the limit by at most one chunk (${pulled.largestChunk})`)
    } else {
      t.equal(pulled.bytes, 0, `${framing}: not a byte read: the Content-Length (${total}) said enough`)
    }
    t.match(error, { receivedBytes: pulled.bytes, declaredBytes: framing === 'chunked' ? null : total }, `${framing}: the error says what was read and what was announced`)
    t.ok(pulled.cancelled, `${framing}: the rest of the body was cancelled`)
    t.ok(await eventually(() => sent.closed), `${framing}: the server saw the connection close`)
    t.ok(!sent.finished && sent.written < total, `${framing}: before the answer was sent whole (${sent.written} of ${total} bytes written)`)
    const { key, headers } = (error ?? {}) as { key?: unknown, headers?: Headers }
    t.equal(`"${String(key)}"`, api.received[0]?.headers['idempotency-key'], `${framing}: the error carries the key the request carried`)
    t.equal(headers?.get('content-type'), 'application/octet-stream', `${framing}: and the answer's headers`)
    t.equal(api.received.length, 1, `${framing}: one request`)
  }
})
