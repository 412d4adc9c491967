import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { InvalidOptionError, memoryStore, type IdempotencyOptions } from '../../lib/index.js'
import { keyed } from '../helpers/app.js'

/**
 * A scope function that returns '' (an auth hook that did not run, a header that was not
 * sent) would put every such caller in one key space, where one replays or blocks another's
 * operation. It is refused, as a server error the app sees in its logs, unless the app asked for it.
 */

interface Harness { app: FastifyInstance, runs: () => number, errors: string[] }

async function harness (t: Test, options: IdempotencyOptions): Promise<Harness> {
  const errors: string[] = []
  const app = Fastify({ logger: { level: 'error', stream: { write: (line: string) => { errors.push(line) } } } })
  t.teardown(() => app.close())
  const store = memoryStore({ purgeInterval: 0 })
  await app.register(idempotency, { store, statusRoute: '/idempotency-keys/:key', ...options })
  let runs = 0
  app.post('/payments', async (_request, reply) => reply.code(201).send({ run: ++runs }))
  return { app, runs: () => runs, errors }
}

const pay = (app: FastifyInstance, account = ''): Promise<LightMyRequestResponse> =>
  app.inject({ method: 'POST', url: '/payments', headers: keyed('k1', { 'x-account': account }), payload: { amount: 1 } })

const fromHeader = (request: { headers: Record<string, unknown> }): string => String(request.headers['x-account'] ?? '')

for (const [kind, scope] of [
  ['a synchronous', fromHeader],
  ['an async', async (request: { headers: Record<string, unknown> }) => fromHeader(request)]
] as const) {
  t.test(`${kind} scope function returning '' is refused with a logged 500, and the handler does not run`, async (t) => {
    const h = await harness(t, { scope })
    for (let attempt = 1; attempt <= 2; attempt++) {
      const res = await pay(h.app)
      t.equal(res.statusCode, 500, `attempt ${attempt}: refused`)
    }
    t.equal(h.runs(), 0, 'the handler never ran, so no caller shares another\'s record')
    t.ok(h.errors.some((line) => line.includes('FST_IDEMPOTENCY_EMPTY_SCOPE') && line.includes('empty string')), 'the reason is logged')

    const own = await pay(h.app, 'acct_a')
    t.equal(own.statusCode, 201, 'a caller with a scope is served')
    const status = await h.app.inject({ method: 'GET', url: '/idempotency-keys/k1' })
    t.equal(status.statusCode, 500, 'the status route refuses it too: it would read the shared scope')
  })
}

t.test('allowEmptyScope: true makes \'\' one shared scope, as asked', async (t) => {
  const h = await harness(t, { scope: fromHeader, allowEmptyScope: true })
  const first = await pay(h.app)
  const again = await pay(h.app)
  t.equal(first.statusCode, 201)
  t.equal(again.headers['idempotent-replayed'], 'true', 'the second anonymous caller gets the first one\'s replay: what the option means')
  t.equal(h.runs(), 1)
  t.same(h.errors, [])
})

t.test('a route\'s own scope is held to the registration\'s allowEmptyScope', async (t) => {
  const h = await harness(t, { scope: () => 'acct' })
  h.app.post('/refunds', { config: { idempotency: { scope: () => '' } } }, async () => ({ refunded: true }))
  const res = await h.app.inject({ method: 'POST', url: '/refunds', headers: keyed('k2'), payload: {} })
  t.equal(res.statusCode, 500)
})

t.test('allowEmptyScope is validated at registration, and is not a route option', async (t) => {
  const app = Fastify()
  t.teardown(() => app.close())
  await t.rejects(async () => { await app.register(idempotency, { allowEmptyScope: 'yes' as unknown as boolean }) },
    { name: 'InvalidOptionError', option: 'option "allowEmptyScope"' })
  const other = Fastify()
  t.teardown(() => other.close())
  await other.register(idempotency, { scope: () => 'acct' })
  t.throws(() => other.post('/x', { config: { idempotency: { allowEmptyScope: true } as never } }, async () => ({})), InvalidOptionError)
})
