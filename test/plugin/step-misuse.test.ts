import type { FastifyInstance, FastifyRequest } from 'fastify'
import t, { type Test } from 'tap'
import { LeaseLostError, memoryStore, type IdempotencyStore } from '../../lib/index.js'
import { buildApp, keyed } from '../helpers/app.js'

/**
 * `request.idempotency.step` and `enqueue` used where they cannot work fail with an error that says
 * why, instead of running the step unrecorded: a step that is not a function, a result that is not
 * JSON, a step after the request's key was settled, a store that records no steps, a store that
 * reports the lease lost (no steps to load, or a step it would not record), and enqueue() on a store
 * without an outbox.
 */

type Context = NonNullable<FastifyRequest['idempotency']>

/** POST /op runs `body` with the request's context; the answer is what it returned, or its error's name and message. */
async function world (t: Test, body: (context: Context) => Promise<unknown>, store?: IdempotencyStore): Promise<FastifyInstance> {
  const app = await buildApp(t, { plugin: store === undefined ? {} : { store } })
  app.post('/op', async (request, reply) => {
    const context = request.idempotency
    if (context === null || context === undefined) throw new Error('unprotected')
    try {
      return reply.code(201).send({ result: await body(context) })
    } catch (err) {
      return reply.code(500).send({ name: (err as Error).name, message: (err as Error).message })
    }
  })
  return app
}

const post = async (app: FastifyInstance, key: string): Promise<{ statusCode: number, body: Record<string, unknown> }> => {
  const response = await app.inject({ method: 'POST', url: '/op', headers: keyed(key), payload: {} })
  return { statusCode: response.statusCode, body: response.json() }
}

t.test('a step that is not a function, and a result that is not JSON, are refused', async (t) => {
  let ran = 0
  const app = await world(t, async (context) => {
    const errors: string[] = []
    try { await context.step('charge', 5 as never) } catch (err) { errors.push((err as Error).message) }
    try { await context.step('big', () => { ran++; return 10n }) } catch (err) { errors.push((err as Error).message) }
    return errors
  })
  const { statusCode, body } = await post(app, 'shapes')
  t.equal(statusCode, 201)
  t.match(body.result, [
    'fastify-idempotency: step("charge", fn) takes a function; received number',
    /a step's result must be JSON-serializable \(Do not know how to serialize a BigInt\)/
  ])
  t.equal(ran, 1, 'the step ran; its result could not be recorded')
})

t.test('a step called once the request\'s key was settled is refused: the request no longer owns it', async (t) => {
  let kept: Context | null = null
  const app = await world(t, async (context) => { kept = context; return 'done' })
  t.equal((await post(app, 'late')).statusCode, 201)
  let ran = false
  await t.rejects((kept as unknown as Context).step('late', () => { ran = true }), { name: 'TypeError', message: 'fastify-idempotency: step("late") can only run in the handler of a request that owns its key' })
  t.equal(ran, false)
})

t.test('a store that records no steps: the step is refused, never run unrecorded', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  const store: IdempotencyStore = { ...inner, loadSteps: undefined, saveStep: undefined }
  let ran = false
  const app = await world(t, async (context) => await context.step('charge', () => { ran = true }), store)
  const { statusCode, body } = await post(app, 'no-steps')
  t.equal(statusCode, 500)
  t.same(body, { name: 'TypeError', message: 'fastify-idempotency: the store does not record steps (it has no loadSteps/saveStep)' })
  t.equal(ran, false)
})

t.test('a store that reports the lease lost: LeaseLostError, whether loading the steps or recording one', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  let loadAnswers: 'steps' | 'lost' = 'lost'
  let runs = 0
  const store: IdempotencyStore = {
    ...inner,
    loadSteps: async (lease) => loadAnswers === 'lost' ? null : await inner.loadSteps(lease),
    saveStep: async () => false
  }
  const app = await world(t, async (context) => await context.step('charge', () => { runs++; return { id: 'ch_1' } }), store)

  const lostOnLoad = await post(app, 'lost-on-load')
  t.match(lostOnLoad.body, { name: 'LeaseLostError', message: /step "charge" was not recorded: this request no longer owns its Idempotency-Key/ })
  t.equal(runs, 0, 'not run: the lease was lost before it')

  loadAnswers = 'steps'
  const lostOnSave = await post(app, 'lost-on-save')
  t.match(lostOnSave.body, { name: 'LeaseLostError' })
  t.equal(runs, 1, 'run once: its record was refused after')
  t.ok(new LeaseLostError('x') instanceof Error)
})

t.test('enqueue() on a store without an outbox is refused with why', async (t) => {
  const app = await world(t, async (context) => await context.enqueue({ name: 'receipt', topic: 'email', payload: {} }))
  const { statusCode, body } = await post(app, 'outbox')
  t.equal(statusCode, 500)
  t.same(body, { name: 'TypeError', message: 'fastify-idempotency: the store has no outbox (Postgres: postgresStore({ sql, outbox: { deliver } }))' })
})
