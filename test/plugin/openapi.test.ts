import swagger from '@fastify/swagger'
import type { FastifyInstance, FastifySchema, LightMyRequestResponse, RouteOptions } from 'fastify'
import t, { type Test } from 'tap'
import { InvalidOptionError, memoryStore, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import { buildApp, deferred, keyed, PROBLEM_TYPE } from '../helpers/app.js'

/*
 * Protected routes document themselves for @fastify/swagger (lib/http/openapi.ts): the Idempotency-Key
 * header parameter, the plugin's problem answers and the replay marker, added to route.schema when
 * the route is added. Fastify compiles that same schema, so the other half of this file checks
 * that nothing a client receives changes: every answer is compared byte for byte with an app
 * registered with `openapi: false`.
 */

interface Header { readonly schema: Record<string, unknown>, readonly description?: string }
interface Media { readonly schema: Record<string, unknown>, readonly examples?: Record<string, { readonly value: unknown }> }
interface Response { readonly description: string, readonly headers?: Record<string, Header>, readonly content?: Record<string, Media> }
interface Parameter { readonly in: string, readonly name: string, readonly required: boolean, readonly description?: string, readonly schema: Record<string, unknown> }
interface Operation { readonly parameters?: Parameter[], readonly responses: Record<string, Response> }

const PROBLEM_JSON = 'application/problem+json'

/** The plugin (memory store, one scope) and @fastify/swagger in OpenAPI 3 mode; routes come next. */
async function documented (t: Test, plugin: IdempotencyOptions = {}): Promise<FastifyInstance> {
  const app = await buildApp(t, { plugin })
  await app.register(swagger, { openapi: { openapi: '3.0.3', info: { title: 'payments', version: '1.0.0' } } })
  return app
}

function operation (app: FastifyInstance, path: string, method: string): Operation {
  const paths = (app.swagger() as unknown as { paths: Record<string, Record<string, Operation>> }).paths
  const op = paths[path]?.[method]
  if (op === undefined) throw new Error(`no ${method} ${path} in the document`)
  return op
}

function keyParameters (op: Operation): Parameter[] {
  return (op.parameters ?? []).filter((p) => p.in === 'header' && p.name.toLowerCase() === 'idempotency-key')
}

function response (op: Operation, status: string): Response {
  const found = op.responses[status]
  if (found === undefined) throw new Error(`no ${status} response`)
  return found
}

function problemMedia (op: Operation, status: string): Media {
  const media = response(op, status).content?.[PROBLEM_JSON]
  if (media === undefined) throw new Error(`no ${PROBLEM_JSON} for ${status}`)
  return media
}

/** Route schemas as Fastify will compile them: an onRoute hook added after the plugin's runs after it. */
function captureSchemas (app: FastifyInstance): Map<string, FastifySchema | undefined> {
  const schemas = new Map<string, FastifySchema | undefined>()
  app.addHook('onRoute', (route: RouteOptions) => { schemas.set(`${String(route.method)} ${route.url}`, route.schema) })
  return schemas
}

t.test('a protected route documents the Idempotency-Key header and every problem the plugin may answer', async (t) => {
  const app = await documented(t, { required: true, keyFormat: 'strict', maxKeyLength: 64, ttl: 2 * 3_600_000, docsUrl: 'https://api.example.com/errors' })
  let runs = 0
  app.post('/payments', async (_request, reply) => { runs++; return reply.code(201).send({ id: `pay_${runs}` }) })
  await app.ready()
  const op = operation(app, '/payments', 'post')

  const [key, ...more] = keyParameters(op)
  t.equal(more.length, 0, 'one Idempotency-Key parameter')
  t.equal(key?.required, true, 'required, as the route\'s settings say')
  t.equal(key?.schema.type, 'string')
  t.match(key?.description, /Structured Field String \(RFC 9651 §3\.3\.3/, 'the draft\'s sf-string')
  t.match(key?.description, /at most 64 characters/, 'maxKeyLength')
  t.match(key?.description, /kept 2 hours after/, 'the retention (draft §2.3)')
  t.notMatch(key?.description, /unquoted/, 'strict keys: no bare form advertised')

  t.same(Object.keys(op.responses).sort(), ['2XX', '400', '409', '410', '413', '422', '503'])
  for (const status of ['400', '409', '410', '413', '422', '503']) {
    const media = problemMedia(op, status)
    t.same(Object.keys(media.schema.properties as object), status === '410'
      ? ['type', 'title', 'status', 'detail', 'originalStatus']
      : ['type', 'title', 'status', 'detail'], `${status}: RFC 9457 members`)
    t.equal(media.schema.additionalProperties, true, `${status}: extension members allowed`)
    t.equal(response(op, status).content?.['application/json'], undefined, `${status}: only the problem media type`)
    t.match(response(op, status).headers?.link?.description, /rel="describedby"/, `${status}: the docsUrl Link`)
  }
  t.ok(response(op, '409').headers?.['retry-after'], '409 documents Retry-After')
  t.ok(response(op, '503').headers?.['retry-after'], '503 documents Retry-After')
  t.equal(response(op, '422').headers?.['retry-after'], undefined, '422 has no Retry-After')
  t.same(Object.keys(problemMedia(op, '400').examples ?? {}), ['key-missing', 'key-invalid', 'body-too-deep'])
  t.same(Object.keys(problemMedia(op, '413').examples ?? {}), ['body-too-large'])
  t.same(response(op, '2XX').headers?.['idempotent-replayed']?.schema, { type: 'string', enum: ['true'] }, 'the replay marker')

  // The examples are the answers the plugin sends.
  const missing = await app.inject({ method: 'POST', url: '/payments', payload: { amount: 1 } })
  t.equal(missing.statusCode, 400)
  t.same(missing.json(), problemMedia(op, '400').examples?.['key-missing']?.value, 'the missing-key answer is the example')
  const first = await app.inject({ method: 'POST', url: '/payments', headers: keyed('k-1'), payload: { amount: 1 } })
  const reused = await app.inject({ method: 'POST', url: '/payments', headers: keyed('k-1'), payload: { amount: 2 } })
  t.equal(first.statusCode, 201)
  t.equal(reused.statusCode, 422)
  t.equal(reused.headers['content-type'], `${PROBLEM_JSON}; charset=utf-8`)
  t.same(reused.json(), problemMedia(op, '422').examples?.['key-reused']?.value, 'the reused-key answer is the example')
  t.equal(runs, 1)
})

t.test('what is documented follows the route\'s settings', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  const app = await documented(t, { store: transactional(inner) })
  app.post('/optional', async () => ({ ok: true }))
  app.post('/bypass', { config: { idempotency: { onStoreError: 'bypass' } } }, async () => ({ ok: true }))
  app.post('/atomic', { config: { idempotency: { transaction: true } } }, async () => ({ ok: true }))
  app.put('/opted-in', { config: { idempotency: { required: true, keyFormat: 'lenient' } } }, async () => ({ ok: true }))
  await app.ready()

  const optional = operation(app, '/optional', 'post')
  t.equal(keyParameters(optional)[0]?.required, false, 'required: false → an optional parameter')
  t.match(keyParameters(optional)[0]?.description, /Optional: a request without it runs without this protection/)
  t.match(keyParameters(optional)[0]?.description, /an unquoted key .* is also accepted/, 'lenient keys')
  t.same(Object.keys(problemMedia(optional, '400').examples ?? {}), ['key-invalid', 'body-too-deep'], 'no missing-key answer when the key is optional')
  t.same(Object.keys(operation(app, '/bypass', 'post').responses).sort(), ['2XX', '400', '409', '410', '413', '422'], 'bypass: no 503')
  t.match(response(operation(app, '/atomic', 'post'), '500').description, /could not be committed/, 'atomic mode: the 500 not-committed answer')
  t.equal(keyParameters(operation(app, '/opted-in', 'put'))[0]?.required, true, 'a method opted in per route, with its own settings')

  const absent = await app.inject({ method: 'POST', url: '/optional', payload: {} })
  t.equal(absent.statusCode, 200, 'an optional key may still be left out: the header schema does not require it')
})

t.test('routes the plugin does not protect are left untouched', async (t) => {
  const app = await documented(t)
  const schemas = captureSchemas(app)
  app.get('/payments', async () => [])
  app.post('/search', { config: { idempotency: false } }, async () => [])
  app.delete('/payments/:id', { schema: { params: { type: 'object', properties: { id: { type: 'string' } } } } }, async () => ({}))
  await app.ready()

  t.equal(schemas.get('GET /payments'), undefined)
  t.equal(schemas.get('POST /search'), undefined)
  t.same(operation(app, '/payments', 'get'), { responses: { 200: { description: 'Default Response' } } })
  t.same(operation(app, '/search', 'post'), { responses: { 200: { description: 'Default Response' } } })
  const del = operation(app, '/payments/{id}', 'delete')
  t.same(keyParameters(del), [])
  t.same(Object.keys(del.responses), ['200'])
})

t.test('a route\'s own header schema and responses are merged into copies, never replaced nor mutated', async (t) => {
  const app = await documented(t, { required: true })
  const schemas = captureSchemas(app)
  // One schema object shared by two routes, as apps often do.
  const shared = {
    headers: { type: 'object', properties: { 'x-tenant': { type: 'string', minLength: 1 } }, required: ['x-tenant'] },
    response: {
      201: { type: 'object', properties: { id: { type: 'string' } } },
      409: { description: 'The order is locked', type: 'object', properties: { code: { type: 'string' } } }
    }
  }
  const before = JSON.stringify(shared)
  let runs = 0
  app.post('/orders', { schema: shared }, async (request, reply) => {
    runs++
    if (request.headers['x-mode'] === 'locked') return reply.code(409).send({ code: 'locked', internal: 'stripped by the app\'s own schema' })
    return reply.code(201).send({ id: `ord_${runs}`, internal: 'stripped' })
  })
  app.patch('/orders', { schema: shared }, async () => ({ id: 'ord_patched' }))
  await app.ready()

  t.equal(JSON.stringify(shared), before, 'the app\'s schema object is unchanged')
  t.notOk('idempotency-key' in shared.headers.properties)
  t.not(schemas.get('POST /orders')?.headers, shared.headers, 'the route got a copy')

  const op = operation(app, '/orders', 'post')
  const tenant = op.parameters?.find((p) => p.name === 'x-tenant')
  t.equal(tenant?.required, true, 'the app\'s own header parameter is kept')
  t.equal(keyParameters(op)[0]?.required, true)
  t.equal(response(op, '409').description, 'The order is locked', 'the app\'s 409 is kept, not replaced')
  t.equal(response(op, '409').content?.[PROBLEM_JSON], undefined)
  t.ok(response(op, '400').content?.[PROBLEM_JSON], 'codes the app did not declare are added')
  t.ok(response(op, '201').headers?.['idempotent-replayed'], 'the app\'s 201 gets the replay marker')
  t.same(response(op, '201').content?.['application/json']?.schema, { type: 'object', properties: { id: { type: 'string' } } })
  t.equal(op.responses['2XX'], undefined, 'no generic 2XX beside the app\'s own 201')
  t.ok(keyParameters(operation(app, '/orders', 'patch'))[0], 'the second route sharing the schema is documented too')

  const noTenant = await app.inject({ method: 'POST', url: '/orders', headers: keyed('o-1'), payload: {} })
  t.equal(noTenant.statusCode, 400)
  t.match(noTenant.json(), { code: 'FST_ERR_VALIDATION', message: /x-tenant/ }, 'the app\'s header validation still runs')
  const created = await app.inject({ method: 'POST', url: '/orders', headers: keyed('o-1', { 'x-tenant': 't1' }), payload: {} })
  t.equal(created.statusCode, 201)
  t.equal(created.body, '{"id":"ord_1"}', 'the app\'s 201 schema still serializes')
  const locked = await app.inject({ method: 'POST', url: '/orders', headers: keyed('o-2', { 'x-tenant': 't1', 'x-mode': 'locked' }), payload: {} })
  t.equal(locked.body, '{"code":"locked"}', 'the app\'s 409 schema still serializes')
  const noKey = await app.inject({ method: 'POST', url: '/orders', headers: { 'x-tenant': 't1' }, payload: {} })
  t.equal(noKey.statusCode, 400)
  t.equal(noKey.json<{ type: string }>().type, PROBLEM_TYPE('key-missing'), 'a missing key still gets the plugin\'s problem, not a validation error')
  t.equal(runs, 2)
})

t.test('header schemas that cannot be extended in place', async (t) => {
  const app = await documented(t)
  const schemas = captureSchemas(app)
  app.addSchema({ $id: 'tenantHeaders', type: 'object', properties: { 'x-tenant': { type: 'string' } }, required: ['x-tenant'] })
  app.post('/ref', { schema: { headers: { $ref: 'tenantHeaders#' } } }, async () => ({ ok: true }))
  const kind = Symbol.for('TypeBox.Kind')
  app.post('/typebox', {
    schema: { headers: { [kind]: 'Object', type: 'object', properties: { 'x-tenant': { [kind]: 'String', type: 'string' } }, required: ['x-tenant'] } }
  }, async () => ({ ok: true }))
  app.post('/own-key', {
    schema: { headers: { type: 'object', properties: { 'Idempotency-Key': { type: 'string', description: 'Our own words' } } } }
  }, async () => ({ ok: true }))
  await app.ready()

  for (const path of ['/ref', '/typebox']) {
    const op = operation(app, path, 'post')
    t.equal(op.parameters?.find((p) => p.name === 'x-tenant')?.required, true, `${path}: the app's parameter`)
    t.equal(keyParameters(op).length, 1, `${path}: and the key`)
    const res = await app.inject({ method: 'POST', url: path, headers: keyed(`k${path}`), payload: {} })
    t.equal(res.statusCode, 400, `${path}: the app's validation still refuses a request without x-tenant`)
    t.match(res.json(), { code: 'FST_ERR_VALIDATION' })
    const ok = await app.inject({ method: 'POST', url: path, headers: keyed(`k${path}`, { 'x-tenant': 't' }), payload: {} })
    t.equal(ok.statusCode, 200)
  }
  t.ok(Array.isArray((schemas.get('POST /ref')?.headers as { allOf?: unknown }).allOf), '$ref: combined with allOf')
  t.equal((schemas.get('POST /typebox')?.headers as Record<symbol, unknown>)[kind], 'Object', 'TypeBox\'s symbol keys survive the copy')

  const own = keyParameters(operation(app, '/own-key', 'post'))
  t.equal(own.length, 1, 'a key the route documents itself is not documented twice')
  t.equal(own[0]?.description, 'Our own words')
})

t.test('a status the route already covers with a range or `default` is left to it', async (t) => {
  const app = await documented(t)
  const error = { type: 'object', properties: { message: { type: 'string' } } }
  app.post('/ranged', { schema: { response: { '4xx': error } } }, async (_request, reply) => reply.code(409).send({ message: 'busy', extra: 1 }))
  app.post('/default', { schema: { response: { default: error } } }, async () => ({ ok: true }))
  await app.ready()

  const ranged = operation(app, '/ranged', 'post')
  t.same(Object.keys(ranged.responses).sort(), ['2XX', '4XX', '503'], '4xx covers 400, 409, 410 and 422')
  t.ok(ranged.responses['4XX']?.headers?.['idempotent-replayed'], 'recorded 4xx answers are replayed: the marker is documented')
  const own409 = await app.inject({ method: 'POST', url: '/ranged', headers: keyed('r-1'), payload: {} })
  t.equal(own409.body, '{"message":"busy"}', 'the app\'s 4xx schema still serializes its 409')
  t.same(Object.keys(operation(app, '/default', 'post').responses), ['default'], '`default` covers everything')
})

t.test('a route declared for several methods, only some protected', async (t) => {
  const app = await documented(t, { required: true })
  let runs = 0
  app.route({ method: ['GET', 'POST'], url: '/mixed', handler: async () => ({ run: ++runs }) })
  await app.ready()

  for (const method of ['get', 'post']) {
    const [key] = keyParameters(operation(app, '/mixed', method))
    t.equal(key?.required, false, `${method}: optional, since the route's one schema serves both methods`)
    t.match(key?.description, /Only POST requests to this path are protected; other methods ignore the header\. POST requests without it are refused/)
    t.match(response(operation(app, '/mixed', method), '409').description, /\(POST requests only\.\)/)
  }
  const get = await app.inject({ method: 'GET', url: '/mixed' })
  t.equal(get.statusCode, 200, 'a GET without a key is not refused by the header schema')
  const post = await app.inject({ method: 'POST', url: '/mixed', payload: {} })
  t.equal(post.statusCode, 400)
  t.equal(post.json<{ type: string }>().type, PROBLEM_TYPE('key-missing'))
  t.equal(runs, 1)
})

t.test('routes written for other schema compilers are left alone', async (t) => {
  const app = await documented(t)
  const schemas = captureSchemas(app)
  /** A validator library's schema object (Zod, Joi...): a class instance, not JSON Schema. */
  class Shape { check (value: unknown): boolean { return typeof value === 'object' && value !== null } }
  const validatorCompiler = ({ schema }: { schema: unknown }) => (data: unknown) =>
    (schema as Shape).check(data) ? { value: data } : { error: new Error('invalid') }
  app.post('/foreign', { schema: { body: new Shape() }, validatorCompiler }, async () => ({ ok: true }))
  await app.ready()

  t.same(Object.keys(schemas.get('POST /foreign') ?? {}), ['body'], 'no headers nor responses added')
  const res = await app.inject({ method: 'POST', url: '/foreign', headers: keyed('f-1'), payload: {} })
  t.equal(res.statusCode, 200, 'its compiler never meets a JSON Schema it cannot read')
})

t.test('openapi: false leaves every route schema as it was', async (t) => {
  const app = await buildApp(t, { plugin: { openapi: false, required: true } })
  const schemas = captureSchemas(app)
  // An app-wide compiler for another schema language: our JSON Schema would break it.
  app.setValidatorCompiler(({ schema }) => (data: unknown) => ((schema as { check: (v: unknown) => boolean }).check(data) ? { value: data } : { error: new Error('invalid') }))
  app.post('/payments', async () => ({ ok: true }))
  await app.ready()
  t.equal(schemas.get('POST /payments'), undefined)
  const res = await app.inject({ method: 'POST', url: '/payments', headers: keyed('p-1'), payload: {} })
  t.equal(res.statusCode, 200)
})

t.test('openapi: \'auto\' (the default) documents only when @fastify/swagger is registered', async (t) => {
  const plain = await buildApp(t, { plugin: { required: true } })
  const plainSchemas = captureSchemas(plain)
  plain.post('/payments', async () => ({ ok: true }))
  await plain.ready()
  t.equal(plainSchemas.get('POST /payments'), undefined, 'no swagger: no schema added, nothing compiled')
  t.equal((await plain.inject({ method: 'POST', url: '/payments', payload: {} })).statusCode, 400, 'still protected')

  const withSwagger = await buildApp(t, { plugin: { required: true } })
  await withSwagger.register(swagger, { openapi: { openapi: '3.0.3', info: { title: 'payments', version: '1.0.0' } } })
  const schemas = captureSchemas(withSwagger)
  withSwagger.post('/payments', async () => ({ ok: true }))
  await withSwagger.ready()
  t.ok(schemas.get('POST /payments')?.headers !== undefined, 'swagger registered: the route is documented')
})

t.test('the openapi option is validated', async (t) => {
  const err = await buildApp(t, { plugin: { openapi: 'yes' as unknown as boolean } }).then(() => null, (e: unknown) => e)
  t.ok(err instanceof InvalidOptionError, 'an InvalidOptionError')
  t.match(err, { option: 'option "openapi"', received: 'yes', message: /must be true, false, 'auto'; received a string of 3 characters/ })
})

t.test('every answer is byte-identical with and without the documentation', async (t) => {
  const run = async (openapi: boolean) => {
    const inner = memoryStore({ purgeInterval: 0 })
    t.teardown(() => inner.close())
    const app = await buildApp(t, { plugin: { openapi, store: failing(inner), required: true, docsUrl: 'https://api.example.com/errors' } })
    const schemas = captureSchemas(app)
    const entered = deferred()
    const gate = deferred()
    const runs = { payments: 0, slow: 0, big: 0, own: 0 }
    app.post('/payments', async (_request, reply) => {
      runs.payments++
      return reply.code(201).header('location', `/payments/${runs.payments}`).send({ id: runs.payments, amount: 10, note: null })
    })
    app.post('/slow', async () => { runs.slow++; entered.resolve(); await gate.promise; return { done: true } })
    app.post('/big', { config: { idempotency: { maxResponseBytes: 8 } } }, async () => { runs.big++; return { padding: 'more than eight bytes' } })
    app.post('/own', async (request, reply) => {
      runs.own++
      // The handler's own 409s, which the plugin records and replays like any answer.
      if (request.headers['x-type'] === 'problem') {
        return reply.code(409).type(PROBLEM_JSON).send({ detail: 'seat taken', type: 'https://example.com/seat', extra: { seat: '12A' }, status: 409 })
      }
      return reply.code(409).send({ z: 'unsorted', a: [1, { b: 2 }], title: 7, extra: true })
    })
    await app.ready()

    const answers: LightMyRequestResponse[] = []
    const send = async (url: string, headers: Record<string, string>, payload: unknown = { amount: 10 }): Promise<void> => {
      answers.push(await app.inject({ method: 'POST', url, headers, payload: payload as object }))
    }
    await send('/payments', { 'content-type': 'application/json' })                   // 400 key-missing
    await send('/payments', { 'idempotency-key': '"open', 'content-type': 'application/json' }) // 400 key-invalid
    await send('/payments', keyed('p-1'))                                                // 201
    await send('/payments', keyed('p-1'))                                                // 201 replayed
    await send('/payments', keyed('p-1'), { amount: 11 })                                // 422
    await send('/payments', keyed('fail-1'))                                             // 503
    const slow = app.inject({ method: 'POST', url: '/slow', headers: keyed('s-1'), payload: {} })
    await entered.promise
    await send('/slow', keyed('s-1'), {})                                                // 409 in flight
    gate.resolve()
    answers.push(await slow)                                                             // 200
    await send('/big', keyed('b-1'), {})                                                 // 200, not retained
    await send('/big', keyed('b-1'), {})                                                 // 410
    await send('/own', keyed('o-1'), {})                                                 // the handler's 409
    await send('/own', keyed('o-1'), {})                                                 // replayed
    await send('/own', keyed('o-2', { 'x-type': 'problem' }), {})                        // the handler's problem
    return { schemas, answers, runs }
  }
  const plain = await run(false)
  const withDocs = await run(true)
  const HANDLER_PROBLEM = 12

  t.same(plain.answers.map((a) => a.statusCode), [400, 400, 201, 201, 422, 503, 409, 200, 200, 410, 409, 409, 409])
  t.same(withDocs.runs, plain.runs, 'the handlers ran the same number of times')
  t.same(plain.runs, { payments: 1, slow: 1, big: 1, own: 2 })
  for (const [i, answer] of withDocs.answers.entries()) {
    const before = plain.answers[i]
    if (before === undefined) throw new Error('missing answer')
    const { date: _a, ...headers } = answer.headers
    const { date: _b, ...headersBefore } = before.headers
    t.equal(answer.statusCode, before.statusCode, `#${i}: status`)
    t.same(headers, headersBefore, `#${i}: headers`)
    if (i === HANDLER_PROBLEM) {
      // The one object serialized by a schema of ours: same members and values, in the schema's
      // order (RFC 8259 §4: members are unordered).
      t.same(answer.json(), before.json(), `#${i}: the same JSON`)
    } else {
      t.equal(answer.body, before.body, `#${i}: body, byte for byte`)
    }
  }
  t.same(withDocs.answers[10]?.json(), { z: 'unsorted', a: [1, { b: 2 }], title: 7, extra: true }, 'the handler\'s 409 keeps every field')
  t.equal(withDocs.answers[11]?.headers['idempotent-replayed'], 'true')
  t.same(withDocs.answers[HANDLER_PROBLEM]?.json(), { detail: 'seat taken', type: 'https://example.com/seat', extra: { seat: '12A' }, status: 409 },
    'the handler\'s own problem object keeps every member')
  t.ok(withDocs.schemas.get('POST /payments')?.headers, 'the documented app did document its routes')
  t.equal(plain.schemas.get('POST /payments'), undefined, 'and the other did not')
})

t.test('each profile is documented with the media type and bodies it sends', async (t) => {
  for (const profile of ['ietf', 'stripe'] as const) {
    const app = await documented(t, { profile, required: true })
    app.post('/payments', async (_request, reply) => reply.code(400).send({ own: 'error', z: 1, a: 2 }))
    await app.ready()
    const op = operation(app, '/payments', 'post')
    const missing = await app.inject({ method: 'POST', url: '/payments', payload: {} })
    const type = String(missing.headers['content-type']).split(';')[0] ?? ''
    const media = response(op, String(missing.statusCode)).content?.[type]
    t.ok(media, `${profile}: the ${missing.statusCode} answer's media type (${type}) is documented`)
    t.same(media?.examples?.['key-missing']?.value, missing.json(), `${profile}: its example is the body sent`)
    const own = await app.inject({ method: 'POST', url: '/payments', headers: keyed('own-1'), payload: {} })
    t.equal(own.body, '{"own":"error","z":1,"a":2}', `${profile}: the handler's own 400 is serialized as before`)
  }
})

/** A store with `claimInTransaction`, enough for a route to declare atomic mode (never called here). */
function transactional (inner: IdempotencyStore): IdempotencyStore {
  return { ...delegate(inner), claimInTransaction: () => Promise.reject(new Error('not used by these tests')) }
}

/** The memory store, except that claims of keys starting with `fail-` fail, as a broken database's would. */
function failing (inner: IdempotencyStore): IdempotencyStore {
  return {
    ...delegate(inner),
    claim: async (request) => {
      if (request.key.startsWith('fail-')) throw new Error('connection refused')
      return inner.claim(request)
    }
  }
}

function delegate (inner: IdempotencyStore): IdempotencyStore {
  return {
    claim: (request) => inner.claim(request),
    complete: (lease, response, ttl) => inner.complete(lease, response, ttl),
    release: (lease) => inner.release(lease),
    renew: (lease, ms) => inner.renew(lease, ms),
    get: (id) => inner.get(id),
    purgeExpired: (limit) => inner.purgeExpired(limit),
    close: () => inner.close()
  }
}
