import type { FastifyInstance, FastifySchema, RouteOptions } from 'fastify'
import t, { type Test } from 'tap'
import type { IdempotencyOptions } from '../../lib/index.js'
import { buildApp } from '../helpers/app.js'

/**
 * What the plugin writes into a protected route's schema (lib/http/openapi.ts) for the shapes a route's
 * own schema can take: header schemas that are `false`, fluent, combinators or carry their own
 * `required`; response entries that are references; schemas in another language than JSON Schema
 * (Zod, Valibot...), which are left alone, since the route's compilers would be handed JSON Schema
 * they cannot read; and the descriptions of the settings they document (a wait, a ttl that is not a
 * whole number of seconds, an optional key on a route protected for some methods only).
 */

const KEY = 'idempotency-key'

/** The app with the plugin documenting every route, and the schemas Fastify will compile, by `METHOD /url`. */
async function documenting (t: Test, plugin: IdempotencyOptions = {}): Promise<{ app: FastifyInstance, schemas: Map<string, FastifySchema | undefined> }> {
  const app = await buildApp(t, { plugin: { openapi: true, ...plugin } })
  const schemas = new Map<string, FastifySchema | undefined>()
  // Added after the plugin's onRoute hook: sees the route as the plugin left it.
  app.addHook('onRoute', (route: RouteOptions) => { schemas.set(`${String(route.method)} ${route.url}`, route.schema) })
  return { app, schemas }
}

type Json = Record<string, any>
const json = (schema: FastifySchema | undefined): Json => schema as unknown as Json

/** A schema object of another library: a class instance, as Zod's and Joi's are. */
class ForeignSchema {
  parse (value: unknown): unknown { return value }
}
/** What a route with foreign schemas needs so Fastify does not compile them itself. */
const ownCompilers = { validatorCompiler: () => () => true, serializerCompiler: () => (data: unknown) => JSON.stringify(data) }

t.test('a wait, a ttl in milliseconds and an optional key on some methods are described as they are', async (t) => {
  const { app, schemas } = await documenting(t, { wait: 2000, ttl: 1500, required: false })
  app.route({ method: ['GET', 'POST'], url: '/mixed', handler: async () => ({}) })
  await app.ready()
  const schema = json(schemas.get('GET,POST /mixed'))
  const key = schema.headers.properties[KEY]
  t.match(key.description, /Keys are kept 1500 ms after their operation completed/)
  t.match(key.description, /Only POST requests to this path are protected; other methods ignore the header\. POST requests without it run unprotected\./)
  t.match(schema.response['409'].description, /still being processed after waiting 2 seconds for it/)
})

t.test('header schemas: false is left alone; fluent, combinators and an own `required` get the key beside theirs', async (t) => {
  const { app, schemas } = await documenting(t, { required: true })
  const tenant = { type: 'object', properties: { 'x-tenant': { type: 'string' } }, required: ['x-tenant'] }
  app.post('/false', { schema: { headers: false as never } }, async () => ({}))
  app.post('/fluent', { schema: { headers: { isFluentSchema: true, valueOf: () => tenant } as never } }, async () => ({}))
  app.post('/any-of', { schema: { headers: { anyOf: [{ required: ['x-a'] }, { required: ['x-b'] }] } } }, async () => ({}))
  app.post('/required', { schema: { headers: tenant } }, async () => ({}))
  app.post('/optional-tenant', { schema: { headers: { type: 'object', properties: { 'x-tenant': { type: 'string' } } } } }, async () => ({}))
  await app.ready()

  t.equal(json(schemas.get('POST /false')).headers, false, '`false` refuses every request: nothing to document')
  const fluent = json(schemas.get('POST /fluent')).headers
  t.same(Object.keys(fluent.properties), ['x-tenant', KEY], 'the fluent schema\'s JSON, with the key added')
  t.same(fluent.required, ['x-tenant', KEY])
  const anyOf = json(schemas.get('POST /any-of')).headers
  t.same(anyOf.allOf[1], { anyOf: [{ required: ['x-a'] }, { required: ['x-b'] }] }, 'theirs kept whole, beside ours')
  t.same(anyOf.allOf[0].required, [KEY])
  t.same(json(schemas.get('POST /required')).headers.required, ['x-tenant', KEY], 'their required headers and the key')
  t.same(json(schemas.get('POST /optional-tenant')).headers.required, [KEY], 'the key alone where they require nothing')
  t.same(tenant.required, ['x-tenant'], 'the app\'s own schema object is not changed')

  const refused = await app.inject({ method: 'POST', url: '/required', headers: { [KEY]: '"k1"', 'content-type': 'application/json' }, payload: {} })
  t.equal(refused.statusCode, 400, 'their required header is still required')
  const accepted = await app.inject({ method: 'POST', url: '/required', headers: { [KEY]: '"k1"', 'x-tenant': 'a', 'content-type': 'application/json' }, payload: {} })
  t.equal(accepted.statusCode, 200)
})

t.test('a response entry that is a reference, or whose headers are not an object, is kept as it is', async (t) => {
  const { app, schemas } = await documenting(t)
  app.addSchema({ $id: 'created', type: 'object', properties: { id: { type: 'string' } } })
  app.post('/ref', { schema: { response: { 201: { $ref: 'created#' } } } }, async (_request, reply) => reply.code(201).send({ id: 'a' }))
  app.post('/odd-headers', { schema: { response: { 201: { type: 'object', headers: [] } } } }, async (_request, reply) => reply.code(201).send({}))
  await app.ready()
  t.same(json(schemas.get('POST /ref')).response['201'], { $ref: 'created#' })
  t.same(json(schemas.get('POST /odd-headers')).response['201'], { type: 'object', headers: [] })
  t.ok(json(schemas.get('POST /ref')).response['409'], 'the plugin\'s answers are documented beside them')
  const created = await app.inject({ method: 'POST', url: '/ref', headers: { [KEY]: '"r1"', 'content-type': 'application/json' }, payload: {} })
  t.same(created.json(), { id: 'a' })
})

t.test('schemas in another language than JSON Schema are left alone, wherever they are', async (t) => {
  const { app, schemas } = await documenting(t)
  const foreign = new ForeignSchema()
  const routes: Record<string, FastifySchema> = {
    '/body-content': { body: { content: { 'application/json': { schema: foreign } } } as never },
    '/response': { response: foreign as never },
    '/response-entry': { response: { 200: foreign } as never },
    '/response-content': { response: { 200: { content: { 'application/json': { schema: foreign } } } } as never }
  }
  for (const [url, schema] of Object.entries(routes)) app.post(url, { schema, ...ownCompilers }, async () => ({ ok: true }))
  app.post('/whole', { schema: foreign as never, ...ownCompilers }, async () => ({ ok: true }))
  await app.ready()
  for (const [url, schema] of Object.entries(routes)) {
    t.equal(schemas.get(`POST ${url}`), schema, `${url}: the route's own schema, untouched`)
    t.same(Object.keys(schema), Object.keys(json(schemas.get(`POST ${url}`))), `${url}: no header or response added`)
  }
  t.equal(schemas.get('POST /whole'), foreign, 'a schema that is not a plain object at all')
  const answered = await app.inject({ method: 'POST', url: '/response-entry', headers: { [KEY]: '"f1"', 'content-type': 'application/json' }, payload: {} })
  t.equal(answered.statusCode, 200, 'the route still works, and is protected')
  const replayed = await app.inject({ method: 'POST', url: '/response-entry', headers: { [KEY]: '"f1"', 'content-type': 'application/json' }, payload: {} })
  t.equal(replayed.headers['idempotent-replayed'], 'true')
})
