import t from 'tap'
import { createIdempotentClient } from '../client/index.js'
import { bystander, serve } from './helpers/http-recorder.js'

/*
 * The client's security options: `redirect: 'same-origin'` follows redirects within the request's
 * origin only, never re-sending the body or the key to a GET.
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
        method: request.method, url: request.url, key: request.headers['idempotency-key'] ?? null,
        apiKey: request.headers['x-api-key'] ?? null, contentType: request.headers['content-type'] ?? null, body: request.body
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
