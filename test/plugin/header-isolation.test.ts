import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type IdempotencyStore } from '../../lib/index.js'

/*
 * Recorded header arrays were shared by reference. The recorded headers were
 * the reply's own arrays, and a replay handed the recorded arrays to the reply, so an app hook that
 * appends to a header array in place (`reply.getHeader('link').push(...)` in onSend) rewrote the
 * recorded answer, for every later replay and, through the memory store's shared header sets, for
 * other tenants' records too; the array grew by one on every replay. Each answer must get headers
 * of its own: nothing a hook does to a reply reaches another request's answer.
 */

/** The handler's array, kept at module level as apps do with constant headers. */
const LINKS = ['</items?page=2>; rel="next"', '</items?page=9>; rel="last"']
const LINKS_AT_START = [...LINKS]

interface World {
  readonly app: FastifyInstance
  readonly runs: () => number
  readonly post: (key: string, tenant: string) => Promise<LightMyRequestResponse>
}

/**
 * An app whose handler sets `link` and `x-trace` (arrays), and whose hooks
 * mutate those arrays in place: onSend appends to every answer's arrays, onResponse mutates the
 * handler's own module-level array after the answer left.
 */
async function world (t: Test, store: IdempotencyStore): Promise<World> {
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, {
    store,
    scope: (request) => String(request.headers['x-tenant']),
    replayHeaders: ['content-type', 'link', 'x-trace']
  })
  let runs = 0
  app.addHook('onSend', async (_request, reply, payload) => {
    const link = reply.getHeader('link')
    if (Array.isArray(link)) link.push('<https://hook.example/added>; rel="hook"')
    const trace = reply.getHeader('x-trace')
    if (Array.isArray(trace)) trace.splice(0, trace.length, 'rewritten-by-hook')
    return payload
  })
  app.addHook('onResponse', async (request) => {
    // The handler's own array, mutated after its answer was recorded and sent.
    if (request.idempotency?.replayed === false) LINKS.push(`</items?after=${runs}>; rel="later"`)
  })
  app.post('/items', async (_request, reply) => {
    runs++
    return reply.code(201).header('link', LINKS).header('x-trace', ['a', 'b']).send({ created: runs })
  })
  await app.ready()
  return {
    app,
    runs: () => runs,
    post: (key, tenant) => app.inject({
      method: 'POST',
      url: '/items',
      headers: { 'idempotency-key': `"${key}"`, 'x-tenant': tenant, 'content-type': 'application/json' },
      payload: { name: 'widget' }
    })
  }
}

function sameAnswer (t: Test, replay: LightMyRequestResponse, original: LightMyRequestResponse, what: string): void {
  t.equal(replay.headers['idempotent-replayed'], 'true', `${what}: a replay`)
  t.equal(replay.statusCode, original.statusCode, `${what}: same status`)
  t.equal(replay.body, original.body, `${what}: same body`)
  t.same(replay.headers.link, original.headers.link, `${what}: same link header as the original answer`)
  t.same(replay.headers['x-trace'], original.headers['x-trace'], `${what}: same x-trace header as the original answer`)
}

t.beforeEach(() => { LINKS.splice(0, LINKS.length, ...LINKS_AT_START) })

t.test('a hook that mutates header arrays in place changes neither the record nor later replays', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const { runs, post } = await world(t, store)

  const original = await post('k1', 'tenant-a')
  t.equal(original.statusCode, 201)
  t.same(original.headers.link, [...LINKS_AT_START, '<https://hook.example/added>; rel="hook"'], 'the hook ran on the original answer')
  t.same(original.headers['x-trace'], ['rewritten-by-hook'])

  for (let i = 1; i <= 5; i++) sameAnswer(t, await post('k1', 'tenant-a'), original, `replay ${i}`)
  t.equal(runs(), 1, 'the handler ran once')

  const stored = await store.get({ scope: 'tenant-a', key: 'k1' })
  t.same(stored?.state === 'completed' && stored.response.headers, {
    'content-type': 'application/json; charset=utf-8',
    link: LINKS_AT_START,
    'x-trace': ['a', 'b']
  }, 'the record holds what the handler set, untouched by the hooks or by the handler\'s later change to its array')
})

t.test('two tenants with identical header sets: one tenant\'s replays cannot change the other\'s answer', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const { runs, post } = await world(t, store)

  const a = await post('same-key', 'tenant-a')
  // The handler's array is reset, so tenant B's record has exactly tenant A's header set.
  LINKS.splice(0, LINKS.length, ...LINKS_AT_START)
  const b = await post('same-key', 'tenant-b')
  t.same(a.headers.link, b.headers.link, 'the two originals carry the same headers')
  t.equal(runs(), 2, 'two scopes: two operations')

  for (let i = 1; i <= 5; i++) sameAnswer(t, await post('same-key', 'tenant-b'), b, `tenant B, replay ${i}`)
  sameAnswer(t, await post('same-key', 'tenant-a'), a, 'tenant A after tenant B\'s replays')
  t.equal(runs(), 2, 'no re-execution')
})

t.test('two encapsulation contexts sharing one store: one context\'s hook does not reach the other\'s replays', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const app = Fastify()
  t.teardown(() => app.close())
  let runs = 0
  for (const prefix of ['/one', '/two']) {
    await app.register(async (child) => {
      await child.register(idempotency, { store, scope: () => 'tenant', replayHeaders: ['content-type', 'link'] })
      if (prefix === '/two') {
        // Only on replays: both originals record the same header set (the memory store shares
        // identical sets between records).
        child.addHook('onSend', async (_request, reply, payload) => {
          const link = reply.getHeader('link')
          if (reply.getHeader('idempotent-replayed') === 'true' && Array.isArray(link)) link.push('<two>; rel="two"')
          return payload
        })
      }
      child.post('/pay', async (_request, reply) => {
        runs++
        return reply.header('link', ['<a>; rel="a"', '<b>; rel="b"']).send({ ok: true })
      })
    }, { prefix })
  }
  await app.ready()
  const post = (url: string, key: string): Promise<LightMyRequestResponse> =>
    app.inject({ method: 'POST', url, headers: { 'idempotency-key': `"${key}"` }, payload: {} })

  const one = await post('/one/pay', 'k-one')
  const two = await post('/two/pay', 'k-two')
  t.same(one.headers.link, ['<a>; rel="a"', '<b>; rel="b"'])
  t.same(two.headers.link, one.headers.link, 'the same header set')
  for (let i = 1; i <= 3; i++) {
    t.same((await post('/two/pay', 'k-two')).headers.link, ['<a>; rel="a"', '<b>; rel="b"', '<two>; rel="two"'], `context two, replay ${i}: its hook added one link`)
    t.same((await post('/one/pay', 'k-one')).headers.link, one.headers.link, `context one, replay ${i}: its original answer`)
  }
  t.equal(runs, 2)
})
