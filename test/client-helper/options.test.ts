import { readdirSync, readFileSync } from 'node:fs'
import { Readable } from 'node:stream'
import type { FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import { createIdempotentClient, InvalidOptionError, type FetchLike, type IdempotentClientOptions } from '../../client/index.js'
import { buildApp } from '../helpers/app.js'
import { startFaultProxy } from '../helpers/fault-proxy.js'

/*
 * The client's options and request arguments are validated before anything is sent, with errors
 * naming the option and the value; bodies of every accepted kind are re-sent byte for byte; the
 * client module stands alone (no Fastify, nothing from lib/).
 */

/** A fetch that must never be called. */
function noFetch (t: Test): FetchLike {
  return async () => { t.fail('fetch was called'); throw new Error('unreachable') }
}

async function listen (t: Test, app: FastifyInstance): Promise<number> {
  await app.listen({ host: '127.0.0.1', port: 0 })
  const address = app.server.address()
  return typeof address === 'object' && address !== null ? address.port : 0
}

t.test('client options are validated once; each error names the option and the value received', async (t) => {
  const cases: Array<[IdempotentClientOptions, string, RegExp]> = [
    [{ maxAttempts: 0 }, 'maxAttempts', /maxAttempts must be an integer from 1 to 100; received 0$/],
    [{ maxAttempts: 2.5 }, 'maxAttempts', /received 2\.5/],
    [{ timeoutMs: '10s' as unknown as number }, 'timeoutMs', /received a string of 3 characters/],
    [{ deadlineMs: -1 }, 'deadlineMs', /received -1/],
    [{ backoff: { baseMs: 500, maxMs: 100 } }, 'backoff.maxMs', /from 500 to/],
    [{ backoff: 5 as unknown as object }, 'backoff', /received 5/],
    [{ retryStatuses: [409, 422] }, 'retryStatuses', /408, 409, 425, 429 and 500 to 599; received an array of 2 items: 409, 422/],
    [{ retryStatuses: 503 as unknown as number[] }, 'retryStatuses', /received 503/],
    [{ baseUrl: 'ftp://example.com' }, 'baseUrl', /absolute http\(s\) URL; received a string of 17 characters/],
    [{ baseUrl: '/relative' }, 'baseUrl', /received a string of 9 characters/],
    [{ headers: { 'Idempotency-Key': 'k' } }, 'headers["idempotency-key"]', /pass the key as the `key` request option/],
    [{ headers: { 'bad header': 'x' } }, 'headers["bad header"]', /valid header name/],
    [{ headers: { authorization: 1 as unknown as string } }, 'headers["authorization"]', /a string; received 1/],
    [{ fetch: 'fetch' as unknown as FetchLike }, 'fetch', /a function/],
    [{ maxAttempt: 3 } as unknown as IdempotentClientOptions, 'maxAttempt', /one of the known options/]
  ]
  for (const [options, option, message] of cases) {
    t.throws(() => createIdempotentClient(options), { name: 'InvalidOptionError', code: 'IDEMPOTENCY_CLIENT_INVALID_OPTION', option, message }, option)
  }
  t.ok(createIdempotentClient({ retryStatuses: [408, 409, 425, 429, 500, 599], backoff: { baseMs: 0, maxMs: 0 } }), 'the edges are accepted')
})

t.test('request arguments are checked before the first attempt; nothing is sent for a bad one', async (t) => {
  const client = createIdempotentClient({ baseUrl: 'http://127.0.0.1:1', fetch: noFetch(t) })
  const refused = async (promise: Promise<unknown>, option: string): Promise<void> => {
    const error = await promise.then(() => null, (err: unknown) => err)
    t.ok(error instanceof InvalidOptionError && error.option === option, `${option} is refused (${String(error)})`)
  }
  await refused(client.post('/x', { key: '' }), 'key')
  await refused(client.post('/x', { key: 'clé' }), 'key')
  await refused(client.post('/x', { key: 'a\nb' }), 'key')
  await refused(client.post('/x', { body: Readable.from(['one-shot']) as unknown as string }), 'body')
  await refused(client.post('/x', { body: new ReadableStream() as unknown as string }), 'body')
  await refused(client.post('/x', { body: new Date() as unknown as string }), 'body')
  await refused(client.post('/x', { body: Number.NaN }), 'body')
  await refused(client.post('/x', { headers: { 'idempotency-key': 'k' } }), 'headers["idempotency-key"]')
  await refused(client.post('/x', { signal: 'stop' as unknown as AbortSignal }), 'signal')
  await refused(client.request('BAD METHOD', '/x'), 'method')
  await refused(createIdempotentClient({ fetch: noFetch(t) }).post('/x'), 'path')
  await t.rejects(client.get('/x', { body: 'not on a GET' }), TypeError, 'fetch\'s own rule, checked up front rather than retried')
  const aborted = AbortSignal.abort(new Error('already'))
  await t.rejects(client.post('/x', { signal: aborted }), { message: 'already' }, 'an aborted signal sends nothing')
})

t.test('every body kind is encoded once and re-sent byte for byte: a raw-fingerprint server replays the retry', async (t) => {
  const app = await buildApp(t, { plugin: { fingerprint: 'raw' }, fastify: { forceCloseConnections: true } })
  app.addContentTypeParser(['application/octet-stream', 'application/x-www-form-urlencoded'], { parseAs: 'buffer' }, (_request, body, done) => { done(null, body) })
  const runs = new Map<string, number>()
  app.post('/echo', async (request) => {
    const key = request.idempotency?.key ?? ''
    runs.set(key, (runs.get(key) ?? 0) + 1)
    const body = request.body
    return { contentType: request.headers['content-type'], body: Buffer.isBuffer(body) ? body.toString('latin1') : body }
  })
  const port = await listen(t, app)
  const proxy = await startFaultProxy({ host: '127.0.0.1', port })
  t.teardown(async () => { await proxy.close() })
  const client = createIdempotentClient({
    baseUrl: `http://127.0.0.1:${proxy.port}`,
    // The first attempt's answer is always lost, the second arrives: the second must be the same request.
    sleep: async () => { proxy.set({ dropReplyProbability: 0 }) }
  })

  const bytes = Uint8Array.from([0, 1, 2, 0xff])
  const cases: Array<[string, Parameters<typeof client.post>[1], string, unknown]> = [
    ['a JSON object', { body: { b: 2, a: [1, 'é'] } }, 'application/json', { b: 2, a: [1, 'é'] }],
    ['a JSON array', { body: [1, 2] }, 'application/json', [1, 2]],
    ['text', { body: 'plain words' }, 'text/plain;charset=UTF-8', 'plain words'],
    ['text with the caller\'s type', { body: '{"pre":"serialised"}', headers: { 'content-type': 'application/json' } }, 'application/json', { pre: 'serialised' }],
    ['a Buffer', { body: Buffer.from(bytes) }, 'application/octet-stream', '\x00\x01\x02\xff'],
    ['a Uint8Array', { body: bytes }, 'application/octet-stream', '\x00\x01\x02\xff'],
    ['an ArrayBuffer', { body: bytes.slice().buffer }, 'application/octet-stream', '\x00\x01\x02\xff'],
    ['form fields', { body: new URLSearchParams({ amount: '5', note: 'a b' }) }, 'application/x-www-form-urlencoded;charset=UTF-8', 'amount=5&note=a+b']
  ]
  for (const [name, options, contentType, echoed] of cases) {
    proxy.set({ dropReplyProbability: 1 })
    const result = await client.post('/echo', options)
    t.same([result.status, result.replayed, result.attempts], [200, true, 2], `${name}: the retry was the same request (a replay, not a 422)`)
    t.same(result.json(), { contentType, body: echoed }, `${name}: sent as ${contentType}`)
    t.equal(runs.get(result.key as string), 1, `${name}: executed once`)
  }
})

t.test('baseUrl keeps its path prefix; default headers are sent and a request\'s own override them', async (t) => {
  const app = await buildApp(t, { fastify: { forceCloseConnections: true } })
  app.post('/api/v1/orders', async (request) => ({ url: request.url, auth: request.headers.authorization, agent: request.headers['x-agent'] }))
  const port = await listen(t, app)
  const client = createIdempotentClient({ baseUrl: `http://127.0.0.1:${port}/api/v1`, headers: { Authorization: 'Bearer default', 'x-agent': 'sdk' } })

  const a = await client.post('/orders?dry=1', { body: {} })
  t.same(a.json(), { url: '/api/v1/orders?dry=1', auth: 'Bearer default', agent: 'sdk' })
  const b = await client.post('orders', { body: {}, headers: { authorization: 'Bearer mine' } })
  t.same(b.json(), { url: '/api/v1/orders', auth: 'Bearer mine', agent: 'sdk' })
  const c = await client.post(new URL(`http://127.0.0.1:${port}/api/v1/orders`), { body: {} })
  t.equal(c.status, 200, 'an absolute URL is used as is')
})

t.test('retryStatuses: 429 is final by default and retried when listed, after its Retry-After', async (t) => {
  const app = await buildApp(t, { fastify: { forceCloseConnections: true } })
  const runs = new Map<string, number>()
  app.post('/limited', async (request, reply) => {
    const key = request.idempotency?.key ?? ''
    runs.set(key, (runs.get(key) ?? 0) + 1)
    // 429 is not recorded by the plugin: the key is released and the retry executes.
    if (runs.get(key) === 1) return reply.code(429).header('retry-after', '2').send({ slow: 'down' })
    return reply.code(201).send({ ok: true })
  })
  const port = await listen(t, app)
  const delays: number[] = []
  const options = { baseUrl: `http://127.0.0.1:${port}`, random: () => 0, sleep: async (ms: number) => { delays.push(ms) } }

  const final = await createIdempotentClient(options).post('/limited', { body: {} })
  t.same([final.status, final.attempts, delays], [429, 1, []], 'by default: one attempt')
  const retried = await createIdempotentClient({ ...options, retryStatuses: [429] }).post('/limited', { body: {} })
  t.same([retried.status, retried.attempts, delays], [201, 2, [2000]], 'listed: retried after Retry-After: 2')
})

t.test('the client entry imports only its own files: no Fastify, nothing from lib/', async (t) => {
  const dir = new URL('../../client/', import.meta.url)
  const files = readdirSync(dir).filter((name) => name.endsWith('.ts'))
  t.ok(files.includes('index.ts'))
  for (const file of files) {
    const source = readFileSync(new URL(file, dir), 'utf8')
    const specifiers = [...source.matchAll(/^\s*(?:import|export)\b[^'"]*?from\s+['"]([^'"]+)['"]/gm), ...source.matchAll(/\bimport\(\s*['"]([^'"]+)['"]/g)].map((m) => m[1])
    t.same(specifiers.filter((s) => s === undefined || !/^\.\/[\w-]+\.js$/.test(s)), [], `${file} imports only sibling modules`)
  }
})
