import swagger from '@fastify/swagger'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { InvalidOptionError, memoryStore, type IdempotencyOptions } from '../../lib/index.js'
import { buildApp, keyed, PROBLEM_TYPE } from '../helpers/app.js'

/*
 * A deeply nested JSON body answered 500 ("Maximum call stack size exceeded")
 * with a key, where the same body without one ran: the canonical walk was recursive. It is
 * iterative now, bounded by maxBodyDepth (400 body-too-deep) and maxBodyNodes (413
 * body-too-large), both checked before anything is claimed, so nothing is recorded for the key.
 */

const JSON_HEADERS = { 'content-type': 'application/json' }

/** `depth` arrays nested in one another around `leaf`, as JSON text ("[[[1]]]" is depth 3). */
function nestedText (depth: number, leaf = '1'): string {
  return '['.repeat(depth) + leaf + ']'.repeat(depth)
}

interface Counted {
  readonly app: FastifyInstance
  readonly runs: () => number
  readonly post: (url: string, headers: Record<string, string>, payload: string) => Promise<LightMyRequestResponse>
}

async function counted (t: Test, extra: Record<string, Record<string, unknown>> = {}): Promise<Counted> {
  const app = await buildApp(t)
  let runs = 0
  const handler = async (): Promise<{ run: number }> => ({ run: ++runs })
  // Each test adds the routes with options of its own, so the others run on code without them.
  const routes: Record<string, Record<string, unknown>> = {
    '/orders': {},
    ...extra
  }
  for (const [url, idem] of Object.entries(routes)) {
    const config = Object.keys(idem).length === 0 ? {} : { config: { idempotency: idem } }
    app.post(url, { bodyLimit: 4 * 1024 * 1024, ...config }, async (_request, reply) => reply.code(201).send(await handler()))
  }
  const post = (url: string, headers: Record<string, string>, payload: string): Promise<LightMyRequestResponse> =>
    app.inject({ method: 'POST', url, headers: { ...JSON_HEADERS, ...headers }, payload })
  return { app, runs: () => runs, post }
}

function problem (res: LightMyRequestResponse): Record<string, unknown> {
  return JSON.parse(res.body) as Record<string, unknown>
}

t.test('a body nested 5,000 levels deep (10 KB) is answered 400 body-too-deep, not 500; the handler never runs', async (t) => {
  const { runs, post } = await counted(t)
  const deep = nestedText(5_000)
  t.ok(deep.length < 11_000, 'a small body')

  const unprotected = await post('/orders', {}, deep)
  t.equal(unprotected.statusCode, 201, 'without a key the route runs')
  t.equal(runs(), 1)

  const refused = await post('/orders', keyed('deep-1'), deep)
  t.equal(refused.statusCode, 400, `a client error, not a 500: ${refused.body.slice(0, 120)}`)
  t.match(refused.headers['content-type'], /^application\/problem\+json/)
  t.equal(problem(refused).type, PROBLEM_TYPE('body-too-deep'))
  t.equal(problem(refused).maxBodyDepth, 128, 'the limit the body went past')
  t.notMatch(refused.body, /call stack|RangeError/, 'no internal message')
  t.equal(runs(), 1, 'the handler did not run')

  // Nothing was recorded for the key: the same key with an acceptable body runs.
  const next = await post('/orders', keyed('deep-1'), '{"amount":1}')
  t.equal(next.statusCode, 201)
  t.equal(next.headers['idempotent-replayed'], undefined)
  t.equal(runs(), 2)
})

t.test('the default maxBodyDepth is 128: a body at 128 levels runs and replays, at 129 it is refused', async (t) => {
  const { runs, post } = await counted(t)
  const first = await post('/orders', keyed('at-limit'), nestedText(128))
  t.equal(first.statusCode, 201)
  const again = await post('/orders', keyed('at-limit'), nestedText(128))
  t.equal(again.statusCode, 201)
  t.equal(again.headers['idempotent-replayed'], 'true', 'the retry is the same request')
  t.equal(again.body, first.body)
  t.equal(runs(), 1)

  const over = await post('/orders', keyed('over-limit'), nestedText(129))
  t.equal(over.statusCode, 400)
  t.equal(problem(over).type, PROBLEM_TYPE('body-too-deep'))
  t.equal(runs(), 1)
})

t.test('with maxBodyDepth raised, a body 10,000 levels deep is fingerprinted (no stack overflow), replayed, and told apart', async (t) => {
  const { runs, post } = await counted(t, { '/deep': { maxBodyDepth: 20_000 } })
  const first = await post('/deep', keyed('very-deep'), nestedText(10_000, '{"b":1,"a":2}'))
  t.equal(first.statusCode, 201, first.body.slice(0, 120))
  const reordered = await post('/deep', keyed('very-deep'), nestedText(10_000, '{ "a": 2, "b": 1 }'))
  t.equal(reordered.statusCode, 201)
  t.equal(reordered.headers['idempotent-replayed'], 'true', 'canonical: member order and spaces do not matter, at any depth')
  const other = await post('/deep', keyed('very-deep'), nestedText(10_000, '{"a":2,"b":3}'))
  t.equal(other.statusCode, 422, 'a different leaf 10,000 levels down is a different request')
  t.equal(runs(), 1)
})

t.test('maxBodyNodes: a body holding more values than the limit is answered 413 body-too-large', async (t) => {
  const { runs, post } = await counted(t, { '/small': { maxBodyNodes: 5 } })
  // An array and its members: [1,2,3,4] is 5 values.
  t.equal((await post('/small', keyed('n-ok'), '[1,2,3,4]')).statusCode, 201)
  const refused = await post('/small', keyed('n-over'), '[1,2,3,4,5]')
  t.equal(refused.statusCode, 413)
  t.equal(problem(refused).type, PROBLEM_TYPE('body-too-large'))
  t.equal(problem(refused).maxBodyNodes, 5)
  t.equal(runs(), 1)
})

t.test('a parsed body far larger than its text (shared references) is refused at the default maxBodyNodes instead of walked', async (t) => {
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { scope: () => 'test', store: memoryStore({ purgeInterval: 0 }) })
  // A parser whose output shares objects between places (as YAML aliases do): `n` doublings of
  // one array, a 3-byte body whose walk would visit 2^(n+1) values.
  app.addContentTypeParser('application/x-doubled', { parseAs: 'string' }, (_request, body, done) => {
    let value: unknown = ['leaf']
    for (let i = 0; i < Number(body); i++) value = [value, value]
    done(null, value)
  })
  let runs = 0
  app.post('/tree', async (_request, reply) => reply.code(201).send({ run: ++runs }))
  const send = (key: string, doublings: number): Promise<LightMyRequestResponse> =>
    app.inject({ method: 'POST', url: '/tree', headers: { ...keyed(key), 'content-type': 'application/x-doubled' }, payload: String(doublings) })
  t.equal((await send('small-tree', 10)).statusCode, 201, '2^11 values: walked')
  const refused = await send('huge-tree', 21)
  t.equal(refused.statusCode, 413, 'about 6 million values: refused once past 1,048,576')
  t.equal((JSON.parse(refused.body) as Record<string, unknown>).maxBodyNodes, 1_048_576)
  t.equal(runs, 1)
})

t.test('raw fingerprints hash bytes, not the parsed body: no depth limit applies', async (t) => {
  const { runs, post } = await counted(t, { '/raw': { fingerprint: 'raw' } })
  const deep = nestedText(5_000)
  t.equal((await post('/raw', keyed('raw-deep'), deep)).statusCode, 201)
  const again = await post('/raw', keyed('raw-deep'), deep)
  t.equal(again.headers['idempotent-replayed'], 'true')
  t.equal(runs(), 1)
})

t.test('maxBodyDepth and maxBodyNodes are validated at registration and per route, naming the option and the value', async (t) => {
  for (const [name, value] of [['maxBodyDepth', 0], ['maxBodyDepth', -1], ['maxBodyDepth', 1.5], ['maxBodyDepth', '128'], ['maxBodyDepth', Number.NaN],
    ['maxBodyNodes', 0], ['maxBodyNodes', 2 ** 60], ['maxBodyNodes', null]] as const) {
    const app = Fastify()
    t.teardown(() => app.close())
    const err = await app.register(idempotency, { scope: () => 's', [name]: value } as IdempotencyOptions).ready().then(() => null, (e: unknown) => e)
    t.ok(err instanceof InvalidOptionError, `${name}: ${String(value)} is refused`)
    t.match((err as Error).message, new RegExp(`option "${name}" must be an integer number of (levels|values) from 1 to`), 'names the option')
    t.same((err as InvalidOptionError).received, value, 'and the value received')

    const routed = Fastify()
    t.teardown(() => routed.close())
    await routed.register(idempotency, { scope: () => 's' })
    const thrown = (() => {
      try {
        routed.post('/x', { config: { idempotency: { [name]: value } } }, async () => ({}))
        return null
      } catch (e) {
        return e
      }
    })()
    const routeErr = thrown ?? await routed.ready().then(() => null, (e: unknown) => e)
    t.ok(routeErr instanceof InvalidOptionError, `route ${name}: ${String(value)} is refused`)
    t.match((routeErr as Error).message, new RegExp(`config\\.idempotency\\.${name}`), 'names the route option')
  }
})

t.test('openapi: a canonical route documents body-too-deep (400) and body-too-large (413); a raw one does not', async (t) => {
  const app = await buildApp(t)
  await app.register(swagger, { openapi: { openapi: '3.0.3', info: { title: 't', version: '1' } } })
  app.post('/canonical', { config: { idempotency: { maxBodyDepth: 32 } } }, async () => ({}))
  app.post('/raw', { config: { idempotency: { fingerprint: 'raw' } } }, async () => ({}))
  await app.ready()
  type Responses = Record<string, { description: string, content?: Record<string, { examples?: Record<string, { value: unknown }> }> }>
  const paths = (app.swagger() as unknown as { paths: Record<string, { post: { responses: Responses } }> }).paths
  const canonical = paths['/canonical']?.post.responses ?? {}
  t.same(Object.keys(canonical['400']?.content?.['application/problem+json']?.examples ?? {}), ['key-invalid', 'body-too-deep'])
  t.match(canonical['400']?.description, /more than 32 levels deep/, 'the route\'s own limit')
  t.same(Object.keys(canonical['413']?.content?.['application/problem+json']?.examples ?? {}), ['body-too-large'])
  const raw = paths['/raw']?.post.responses ?? {}
  t.equal(raw['413'], undefined, 'raw: no 413')
  t.same(Object.keys(raw['400']?.content?.['application/problem+json']?.examples ?? {}), ['key-invalid'])
})
