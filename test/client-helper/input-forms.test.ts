import t from 'tap'
import { createIdempotentClient, InvalidOptionError, type FetchLike } from '../../client/index.js'

/**
 * The forms the client's inputs may take beyond the common ones: a path given as a URL, with and
 * without `baseUrl`; `baseUrl` given as a URL; null and booleans as JSON bodies. What it refuses
 * before sending anything: a path that is not an absolute http(s) URL when there is no `baseUrl`,
 * a URL of another scheme, options or headers that are not plain records, a body that is no JSON
 * value. A redirect whose Location cannot be parsed is the answer, not a hop.
 */

interface Sent { url: string, method: string, body: string | null, contentType: string | null }

function recording (): FetchLike & { sent: Sent[] } {
  const sent: Sent[] = []
  return Object.assign(async (input: string | URL | Request, init?: RequestInit): Promise<Response> => {
    const headers = new Headers(init?.headers)
    sent.push({ url: String(input), method: init?.method ?? 'GET', body: typeof init?.body === 'string' ? init.body : null, contentType: headers.get('content-type') })
    return new Response('{}', { status: 200, headers: { 'content-type': 'application/json' } })
  }, { sent })
}

t.test('without baseUrl: an absolute http(s) URL, as text or as a URL; anything else is refused', async (t) => {
  const fetch = recording()
  const client = createIdempotentClient({ fetch })
  await client.post('https://api.test/v1/pay?x=1', { body: {} })
  await client.post(new URL('http://api.test/v1/refund'), { body: {} })
  t.same(fetch.sent.map((s) => s.url), ['https://api.test/v1/pay?x=1', 'http://api.test/v1/refund'])
  for (const path of ['/v1/pay', 'ftp://api.test/file', new URL('ftp://api.test/file'), 42]) {
    await t.rejects(client.post(path as string, { body: {} }), { name: 'InvalidOptionError', option: 'path', message: /an absolute http\(s\) URL \(no baseUrl is set\)/ }, String(path))
  }
  t.equal(fetch.sent.length, 2, 'nothing else was sent')
})

t.test('with baseUrl given as a URL: a path as a URL inside it is sent; a URL of another scheme, or a number, is refused', async (t) => {
  const fetch = recording()
  const base = new URL('https://api.test/v1')
  const client = createIdempotentClient({ baseUrl: base, fetch })
  await client.post(new URL('https://api.test/v1/pay'), { body: {} })
  await client.post('refunds', { body: {} })
  t.same(fetch.sent.map((s) => s.url), ['https://api.test/v1/pay', 'https://api.test/v1/refunds'], 'relative to the base path, which got its trailing slash')
  t.equal(base.href, 'https://api.test/v1', 'the caller\'s URL is not changed')
  for (const path of [new URL('mailto:someone@api.test'), 42]) {
    await t.rejects(client.post(path as unknown as string, { body: {} }), { name: 'InvalidOptionError', option: 'path', message: /a path or an http\(s\) URL/ }, String(path))
  }
  t.equal(fetch.sent.length, 2)
})

t.test('null and booleans are sent as JSON; a function or a symbol is not a body', async (t) => {
  const fetch = recording()
  const client = createIdempotentClient({ baseUrl: 'https://api.test', fetch })
  for (const body of [null, true, false]) await client.post('/flag', { body })
  t.same(fetch.sent.map((s) => [s.body, s.contentType]), [['null', 'application/json'], ['true', 'application/json'], ['false', 'application/json']])
  for (const body of [() => 1, Symbol('x')]) {
    await t.rejects(client.post('/flag', { body: body as never }), { name: 'InvalidOptionError', option: 'body' })
  }
  t.equal(fetch.sent.length, 3)
})

t.test('options and headers that are not plain records are refused by name', async (t) => {
  t.throws(() => createIdempotentClient(null as never), { name: 'InvalidOptionError', option: 'options', message: /options must be an object/ })
  t.throws(() => createIdempotentClient('https://api.test' as never), { name: 'InvalidOptionError', option: 'options' })
  for (const headers of [new Headers({ 'x-api-key': 'k' }), [['x-api-key', 'k']], 'x-api-key: k', null]) {
    t.throws(() => createIdempotentClient({ headers: headers as never }), { name: 'InvalidOptionError', option: 'headers', message: /a record of header names to string values/ })
  }
  const fetch = recording()
  const client = createIdempotentClient({ baseUrl: 'https://api.test', fetch })
  await t.rejects(client.post('/pay', { body: {}, headers: new Headers({ 'x-api-key': 'k' }) as never }), { name: 'InvalidOptionError', option: 'headers' })
  t.equal(fetch.sent.length, 0)
  t.ok(InvalidOptionError.prototype instanceof TypeError)
})

t.test('a redirect whose Location cannot be parsed is the answer, not a hop', async (t) => {
  let calls = 0
  const fetch: FetchLike = async () => { calls++; return new Response(null, { status: 307, headers: { location: 'http://[::1' } }) }
  const client = createIdempotentClient({ baseUrl: 'https://api.test', redirect: 'same-origin', fetch })
  const answer = await client.post('/pay', { body: {} })
  t.equal(answer.status, 307)
  t.equal(answer.headers.get('location'), 'http://[::1')
  t.equal(calls, 1, 'not followed')
})
