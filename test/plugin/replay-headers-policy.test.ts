import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { InvalidOptionError, memoryStore, type IdempotencyOptions } from '../../lib/index.js'

/*
 * `replayHeaders` refuses credential-, session- and security-policy-style names. A recorded header goes to whoever replays the key, so a challenge or a session
 * (`www-authenticate`, `authentication-info`, cookies), a credential echoed back, or a policy the
 * server computes per request and per origin (HSTS, CSP, `clear-site-data`, `alt-svc`, CORS) would
 * be handed to another client, or outlive the policy it was computed under. Such a name is refused
 * where the option is validated (registration, or when the route is added), naming the option and
 * the value received; `unsafeReplayHeaders` forces one, by name; the never-replayed set stays
 * refused even there.
 */

const REFUSED = [
  'www-authenticate', 'authentication-info', 'proxy-authentication-info', 'authorization', 'cookie', 'set-cookie2', 'cookie2',
  'clear-site-data', 'strict-transport-security', 'alt-svc', 'content-security-policy', 'content-security-policy-report-only',
  'access-control-allow-origin', 'access-control-allow-credentials', 'access-control-expose-headers', 'access-control-max-age',
  'Access-Control-Allow-Headers', 'WWW-Authenticate'
]

async function boot (t: Test, options: IdempotencyOptions, route?: (app: FastifyInstance) => void): Promise<unknown> {
  const app = Fastify()
  t.teardown(() => app.close())
  try {
    await app.register(idempotency, { store: memoryStore({ purgeInterval: 0 }), scope: () => 'tenant', ...options })
    route?.(app)
    await app.ready()
    return null
  } catch (err) {
    return err
  }
}

function refusedFor (t: Test, err: unknown, option: string, header: string): void {
  t.type(err, InvalidOptionError, `${header}: refused`)
  if (!(err instanceof InvalidOptionError)) return
  const error = err
  t.equal(error.option, option, `${header}: names the option`)
  t.equal(error.received, header, `${header}: carries the value received`)
  t.match(error.message, `${option} must be`, `${header}: the message names the option`)
  t.match(error.message, `received '${header}'`, `${header}: the message shows the value received`)
}

t.test('replayHeaders refuses credential, cookie and security-policy headers at registration', async (t) => {
  for (const header of REFUSED) {
    refusedFor(t, await boot(t, { replayHeaders: ['content-type', header] }), 'option "replayHeaders"', header)
  }
  t.match(((await boot(t, { replayHeaders: ['www-authenticate'] })) as Error).message, /unsafeReplayHeaders/, 'the message says how to force one')
  t.equal(await boot(t, { replayHeaders: ['content-type', 'location', 'x-request-id', 'cache-control', 'vary', 'retry-after'] }), null,
    'ordinary representation and resource headers are accepted')
})

t.test('replayHeaders in a route config is checked when the route is added', async (t) => {
  for (const header of ['www-authenticate', 'cookie', 'access-control-allow-origin', 'strict-transport-security']) {
    const err = await boot(t, {}, (app) => {
      app.post('/login', { config: { idempotency: { replayHeaders: ['content-type', header] } } }, async () => ({ ok: true }))
    })
    refusedFor(t, err, 'route POST /login config.idempotency.replayHeaders', header)
  }
})

t.test('unsafeReplayHeaders forces a refused header, by name; it is validated likewise', async (t) => {
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, {
    store: memoryStore({ purgeInterval: 0 }),
    scope: () => 'tenant',
    unsafeReplayHeaders: ['WWW-Authenticate']
  })
  let runs = 0
  app.post('/challenge', async (_request, reply) => {
    runs++
    return reply.code(202).header('www-authenticate', 'Bearer realm="a", error="insufficient_scope"')
      .header('authentication-info', 'nextnonce="abc"').send({ queued: runs })
  })
  app.post('/per-route', { config: { idempotency: { unsafeReplayHeaders: ['authentication-info'] } } }, async (_request, reply) => {
    runs++
    return reply.header('www-authenticate', 'Basic').header('authentication-info', 'nextnonce="def"').send({ queued: runs })
  })
  await app.ready()
  const post = (url: string, key: string) => app.inject({ method: 'POST', url, headers: { 'idempotency-key': `"${key}"` }, payload: {} })

  const first = await post('/challenge', 'c1')
  const replay = await post('/challenge', 'c1')
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal(replay.headers['www-authenticate'], first.headers['www-authenticate'], 'a forced header is recorded and replayed')
  t.equal(replay.headers['authentication-info'], undefined, 'a sensitive header not forced is not')
  t.equal(replay.headers['content-type'], first.headers['content-type'], 'the default replayHeaders still apply')

  await post('/per-route', 'c2')
  const routeReplay = await post('/per-route', 'c2')
  t.equal(routeReplay.headers['authentication-info'], 'nextnonce="def"', 'a route forces its own')
  t.equal(routeReplay.headers['www-authenticate'], undefined, 'a route list replaces the inherited one')
  t.equal(runs, 2)

  const cases: Array<[IdempotencyOptions, string, unknown]> = [
    [{ unsafeReplayHeaders: 'www-authenticate' as never }, 'option "unsafeReplayHeaders"', 'www-authenticate'],
    [{ unsafeReplayHeaders: ['www authenticate'] }, 'option "unsafeReplayHeaders"', 'www authenticate'],
    [{ unsafeReplayHeaders: ['set-cookie'] }, 'option "unsafeReplayHeaders"', 'set-cookie'],
    [{ unsafeReplayHeaders: ['proxy-authorization'] }, 'option "unsafeReplayHeaders"', 'proxy-authorization'],
    [{ unsafeReplayHeaders: ['Transfer-Encoding'] }, 'option "unsafeReplayHeaders"', 'Transfer-Encoding'],
    [{ unsafeReplayHeaders: ['x-request-id'] }, 'option "unsafeReplayHeaders"', 'x-request-id']
  ]
  for (const [options, option, received] of cases) {
    const err = await boot(t, options)
    t.type(err, InvalidOptionError, `${String(received)}: refused`)
    t.equal((err as InvalidOptionError).option, option)
    t.equal((err as InvalidOptionError).received, received)
  }
  t.match(((await boot(t, { unsafeReplayHeaders: ['set-cookie'] })) as Error).message, /never replayed/, 'the never-replayed set stays refused when forced')
  t.match(((await boot(t, { unsafeReplayHeaders: ['x-request-id'] })) as Error).message, /replayHeaders/, 'an ordinary header belongs in replayHeaders')
})
