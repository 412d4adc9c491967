import { request as httpRequest, type IncomingHttpHeaders } from 'node:http'
import type { AddressInfo } from 'node:net'
import cors, { type FastifyCorsOptions } from '@fastify/cors'
import type { FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import { corsOptions } from '../../examples/cors.js'
import { memoryStore, type IdempotencyContext, type IdempotencyStore } from '../../lib/index.js'
import { buildApp, deferred, PROBLEM_TYPE } from '../helpers/app.js'

/*
 * The README's CORS recipe (examples/cors.ts), over real HTTP: a browser's preflight for a keyed
 * request is allowed without a key and never reaches the plugin, and the replay marker and
 * Retry-After are exposed to page scripts on replays and 409s (Fetch standard: Idempotency-Key is
 * not a safelisted request header, Idempotent-Replayed and Retry-After are not safelisted response
 * headers).
 */

const APP = 'https://app.example.com'
const ADMIN = 'https://admin.example.com'

interface Answer { readonly status: number, readonly headers: IncomingHttpHeaders, readonly body: string }

interface Server {
  readonly port: number
  readonly claims: () => number
  readonly runs: Map<string, number>
  /** request.idempotency of every request, in order of completion. */
  readonly seen: Array<{ method: string, idempotency: IdempotencyContext | null }>
  readonly slow: { entered: Promise<void>, release: () => void }
}

/** The plugin (keys required), then @fastify/cors with the recipe, listening on a free port. */
async function serve (t: Test, options: FastifyCorsOptions = { ...corsOptions, origin: [...corsOptions.origin, ADMIN] }): Promise<Server> {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  let claims = 0
  const store: IdempotencyStore = {
    ...inner,
    claim: (request) => { claims++; return inner.claim(request) }
  }
  const app: FastifyInstance = await buildApp(t, { plugin: { store, required: true } })
  // After the plugin, so its onRoute hook sees @fastify/cors's `OPTIONS *` route too.
  await app.register(cors, options)
  const runs = new Map<string, number>()
  const seen: Server['seen'] = []
  const count = (name: string): number => { const n = (runs.get(name) ?? 0) + 1; runs.set(name, n); return n }
  app.addHook('onResponse', async (request) => { seen.push({ method: request.method, idempotency: request.idempotency }) })

  const entered = deferred()
  const gate = deferred()
  app.post('/payments', async (_request, reply) => reply.code(201).send({ id: `pay_${count('POST /payments')}` }))
  app.patch('/payments/:id', async () => ({ updated: count('PATCH /payments/:id') }))
  app.post('/slow', async () => { count('POST /slow'); entered.resolve(); await gate.promise; return { done: true } })
  // Every method of this route opted in, OPTIONS included.
  app.all('/everything', { config: { idempotency: true } }, async (request) => ({ method: request.method, run: count('ALL /everything') }))
  await app.listen({ host: '127.0.0.1', port: 0 })
  return {
    port: (app.server.address() as AddressInfo).port,
    claims: () => claims,
    runs,
    seen,
    slow: { entered: entered.promise, release: () => { gate.resolve() } }
  }
}

function send (port: number, method: string, path: string, headers: Record<string, string>, body?: unknown): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const payload = body === undefined ? undefined : JSON.stringify(body)
    const req = httpRequest({ host: '127.0.0.1', port, method, path, headers: payload === undefined ? headers : { ...headers, 'content-type': 'application/json' } }, (res) => {
      let text = ''
      res.setEncoding('utf8')
      res.on('data', (chunk: string) => { text += chunk })
      res.on('end', () => resolve({ status: res.statusCode ?? 0, headers: res.headers, body: text }))
    })
    req.on('error', reject)
    req.end(payload)
  })
}

function preflight (port: number, path: string, method: string, origin = APP): Promise<Answer> {
  return send(port, 'OPTIONS', path, {
    origin,
    'access-control-request-method': method,
    'access-control-request-headers': 'idempotency-key, content-type'
  })
}

/** A comma-separated header as a lower-cased list. */
function list (value: string | string[] | undefined): string[] {
  return String(value ?? '').split(',').map((item) => item.trim().toLowerCase()).filter((item) => item !== '')
}

t.test('a browser\'s preflight for a keyed PATCH or POST is allowed, and never reaches the plugin', async (t) => {
  const server = await serve(t)
  for (const [path, method] of [['/payments/pay_1', 'PATCH'], ['/payments', 'POST'], ['/everything', 'POST']] as const) {
    const res = await preflight(server.port, path, method)
    t.equal(res.status, 204, `${method} ${path}: the preflight succeeds without a key`)
    t.equal(res.headers['access-control-allow-origin'], APP)
    t.ok(list(res.headers['access-control-allow-methods']).includes(method.toLowerCase()), `${method} is allowed`)
    t.same(list(res.headers['access-control-allow-headers']).sort(), ['content-type', 'idempotency-key'])
    t.equal(res.headers['access-control-max-age'], '600')
    t.ok(list(res.headers.vary).includes('origin'), 'Vary: Origin, as the answer depends on it')
    t.equal(res.body, '')
  }
  t.equal(server.claims(), 0, 'no preflight claimed a key: nothing was recorded')
  t.same(server.runs, new Map(), 'no handler ran')
  t.same(server.seen, [{ method: 'OPTIONS', idempotency: null }, { method: 'OPTIONS', idempotency: null }, { method: 'OPTIONS', idempotency: null }])

  const stranger = await preflight(server.port, '/payments', 'POST', 'https://evil.example.net')
  t.equal(stranger.headers['access-control-allow-origin'], undefined, 'an origin outside the list is not allowed')
})

t.test('without the recipe\'s `methods`, @fastify/cors does not allow PATCH', async (t) => {
  const { methods: _methods, ...withoutMethods } = corsOptions
  const server = await serve(t, { ...withoutMethods, origin: [APP] })
  const res = await preflight(server.port, '/payments/pay_1', 'PATCH')
  t.same(list(res.headers['access-control-allow-methods']), ['get', 'head', 'post'], 'the default: a browser would refuse to send the PATCH')
})

t.test('cross-origin answers expose the replay marker and Retry-After', async (t) => {
  const server = await serve(t)
  const keyed = (origin: string, key: string): Record<string, string> => ({ origin, 'idempotency-key': `"${key}"` })

  const first = await send(server.port, 'POST', '/payments', keyed(APP, 'k-1'), { amount: 10 })
  t.equal(first.status, 201)
  t.equal(first.headers['access-control-allow-origin'], APP)
  t.same(list(first.headers['access-control-expose-headers']), ['idempotent-replayed', 'retry-after'])
  t.equal(first.headers['idempotent-replayed'], undefined)

  // The same key from the app's other origin (same scope): the recorded answer, with this request's CORS headers.
  const replay = await send(server.port, 'POST', '/payments', keyed(ADMIN, 'k-1'), { amount: 10 })
  t.equal(replay.status, 201)
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal(replay.body, first.body)
  t.equal(replay.headers['access-control-allow-origin'], ADMIN, 'CORS headers are the request\'s own, never recorded ones')
  t.same(list(replay.headers['access-control-expose-headers']), ['idempotent-replayed', 'retry-after'])
  t.equal(server.runs.get('POST /payments'), 1)

  const original = send(server.port, 'POST', '/slow', keyed(APP, 's-1'), {})
  await server.slow.entered
  const conflict = await send(server.port, 'POST', '/slow', keyed(APP, 's-1'), {})
  server.slow.release()
  t.equal((await original).status, 200)
  t.equal(conflict.status, 409)
  t.equal(conflict.headers['retry-after'], '1')
  t.equal(conflict.headers['access-control-allow-origin'], APP)
  t.same(list(conflict.headers['access-control-expose-headers']), ['idempotent-replayed', 'retry-after'])
  t.equal(server.runs.get('POST /slow'), 1)

  const missing = await send(server.port, 'POST', '/payments', { origin: APP }, { amount: 10 })
  t.equal(missing.status, 400)
  t.equal(missing.headers['access-control-allow-origin'], APP, 'a page script can read the problem, not just a network error')
  t.equal((JSON.parse(missing.body) as { type: string }).type, PROBLEM_TYPE('key-missing'))
})
