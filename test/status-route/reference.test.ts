import { randomBytes } from 'node:crypto'
import Fastify, { type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type IdempotencyKeyStatus, type IdempotencyOptions } from '../../lib/index.js'

/*
 * The status route showed a `rebuild` record's internal reference as its body,
 * with the internal marker field among the headers: data the client was never sent. The status
 * route does not know which route recorded the key (nor its rebuild function, its serializer or
 * the original request a rebuild may read), so it answers such a record with its status and its
 * recorded replayable headers and `body: null`, as for a body that was not retained; a retry of
 * the request gets the rebuilt answer.
 */

/** What the handler records as its reference: never sent to the client. */
const INTERNAL = `ledger-row-${randomBytes(6).toString('hex')}`

async function api (t: Test, options: IdempotencyOptions = {}) {
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, {
    store: memoryStore({ purgeInterval: 0 }),
    scope: (request) => String(request.headers['x-account']),
    statusRoute: { url: '/idempotency-keys/:key', includeBody: true },
    ...options
  })
  let runs = 0
  let rebuilds = 0
  app.post('/payments', {
    config: {
      idempotency: {
        rebuild: async (reference) => {
          rebuilds++
          return { body: { id: 'pay_1', status: 'settled', rebuiltFrom: typeof reference } }
        }
      }
    }
  }, async (request, reply) => {
    runs++
    if (request.idempotency !== null) request.idempotency.reference = { row: INTERNAL }
    return reply.code(201).header('location', '/payments/pay_1').send({ id: 'pay_1', status: 'pending' })
  })
  await app.ready()
  const headers = { 'idempotency-key': '"k1"', 'x-account': 'acct_a' }
  return {
    runs: () => runs,
    rebuilds: () => rebuilds,
    post: (): Promise<LightMyRequestResponse> => app.inject({ method: 'POST', url: '/payments', headers, payload: { amount: 1 } }),
    status: (): Promise<LightMyRequestResponse> => app.inject({ method: 'GET', url: '/idempotency-keys/k1', headers: { 'x-account': 'acct_a' } })
  }
}

for (const [name, options] of [['in clear', {}], ['encrypted at rest', { encryption: { keys: [{ id: 'k', key: randomBytes(32) }] } }]] as const) {
  t.test(`${name}: a rebuild record is answered with its status and headers, body null; never the reference or the marker`, async (t) => {
    const { runs, rebuilds, post, status } = await api(t, options)
    const first = await post()
    t.equal(first.statusCode, 201)
    t.notOk(first.body.includes(INTERNAL), 'the client never saw the reference')

    const answer = await status()
    t.equal(answer.statusCode, 200)
    t.notOk(answer.body.includes(INTERNAL), 'the status route does not show the reference')
    t.notOk(answer.body.includes('fastify-idempotency/'), 'nor the internal marker field')
    t.same(answer.json<IdempotencyKeyStatus>(), {
      state: 'completed',
      response: {
        status: 201,
        headers: { 'content-type': 'application/json; charset=utf-8', location: '/payments/pay_1' },
        body: null
      }
    })
    for (const header of Object.keys(answer.headers)) t.notOk(header.startsWith('fastify-idempotency'), `no internal header on the answer (${header})`)

    const replay = await post()
    t.same(replay.json(), { id: 'pay_1', status: 'settled', rebuiltFrom: 'object' }, 'a retry gets the rebuilt answer')
    t.equal(runs(), 1)
    t.equal(rebuilds(), 1, 'the status route ran no rebuild')
  })
}
