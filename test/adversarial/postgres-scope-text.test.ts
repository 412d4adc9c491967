import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency from '../../lib/index.js'
import type { IdempotencyStore } from '../../lib/core/store.js'
import { postgresFixture } from './services.js'
import { errorLog } from './support.js'

/*
 * Scopes are whatever the application's scope function returns: any JS string. PostgreSQL text is
 * UTF-8 without NUL, so two kinds of strings do not survive the trip as themselves:
 * - a string with a lone surrogate (say an account id decoded from JSON "\ud800"): postgres.js
 *   encodes it as UTF-8, which turns every lone surrogate into U+FFFD, so distinct scopes become
 *   one row key and one principal is replayed another's response (draft §5);
 * - a string with U+0000: PostgreSQL refuses it, and the claim fails.
 * The plugin therefore refuses both kinds of scope before any store sees them (lib/fastify/claim.ts).
 */

async function scopedApp (t: Test, store: IdempotencyStore, scopes: readonly string[]): Promise<{ app: FastifyInstance, runs: () => number, errors: string[] }> {
  const log = errorLog()
  const app = Fastify({ logger: log.logger })
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: (request) => scopes[Number(request.headers['x-principal'])] as string })
  let runs = 0
  app.post('/pay', async (request, reply) => {
    runs++
    return reply.code(201).send({ principal: Number(request.headers['x-principal']) })
  })
  return { app, runs: () => runs, errors: log.lines }
}

const pay = (app: FastifyInstance, principal: number): Promise<LightMyRequestResponse> =>
  app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': '"k"', 'content-type': 'application/json', 'x-principal': String(principal) }, payload: { amount: 1 } })

t.test('scopes with lone surrogates never receive another scope\'s response', async (t) => {
  const pg = postgresFixture(t)
  if (pg === null) return
  const scopes = ['\ud800', '\udbff', '\ufffd', 'x\udc00y', 'x\ufffdy']
  const h = await scopedApp(t, await pg.store('surrogates'), scopes)
  for (const [principal, scope] of scopes.entries()) {
    const res = await pay(h.app, principal)
    const label = `scope ${JSON.stringify(scope)}`
    if (res.statusCode === 201) {
      t.equal(res.headers['idempotent-replayed'], undefined, `${label}: its own execution, not a replay`)
      t.same(res.json(), { principal }, `${label}: its own response`)
    } else {
      // Refusing a scope PostgreSQL cannot store apart is as safe as storing it apart.
      t.ok(res.statusCode >= 400, `${label}: refused (${res.statusCode})`)
    }
  }
})

t.test('a scope containing NUL is refused by the plugin (500, logged), the handler does not run, other scopes are unaffected', async (t) => {
  const pg = postgresFixture(t)
  if (pg === null) return
  const h = await scopedApp(t, await pg.store('nul'), ['a\u0000b', 'a', 'ab'])
  for (let attempt = 0; attempt < 2; attempt++) {
    const res = await pay(h.app, 0)
    t.equal(res.statusCode, 500, `attempt ${attempt + 1}: refused as a server error (the scope is the app's value)`)
  }
  t.equal(h.runs(), 0, 'the handler never ran')
  for (const principal of [1, 2]) {
    const res = await pay(h.app, principal)
    t.equal(res.statusCode, 201, `scope ${principal}: executes`)
    t.same(res.json(), { principal })
  }
  t.equal(h.runs(), 2)
  t.ok(h.errors.some((line) => /lone surrogate or a NUL/.test(line)), 'the reason is logged')
})

t.test('the status route refuses a lone-surrogate scope too: it cannot read the U+FFFD scope\'s key', async (t) => {
  const pg = postgresFixture(t)
  if (pg === null) return
  const store = await pg.store('status')
  const scopes = ['\ufffd', '\ud800']
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: (request) => scopes[Number(request.headers['x-principal'])] as string, statusRoute: '/idempotency-keys/:key' })
  app.post('/pay', async (_request, reply) => reply.code(201).send({ secret: 'of principal 0' }))
  t.equal((await pay(app, 0)).statusCode, 201)
  const own = await app.inject({ method: 'GET', url: '/idempotency-keys/k', headers: { 'x-principal': '0' } })
  t.equal(own.statusCode, 200, 'the owner sees its key')
  const other = await app.inject({ method: 'GET', url: '/idempotency-keys/k', headers: { 'x-principal': '1' } })
  t.equal(other.statusCode, 500, 'a scope PostgreSQL would turn into U+FFFD is refused, not looked up')
  t.notOk(other.body.includes('completed'), 'nothing of the other principal\'s record')
})
