import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest, type RouteShorthandOptions } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore } from '../../lib/index.js'
import { countingStore } from './counting-store.js'

/*
 * The claim (where the `key` option is read) is the route's last preHandler: a verification hook
 * anywhere before it answers first, and a request it refuses never reaches the store. That is what
 * keeps a forged delivery from claiming a real event's id before the real one arrives. Each place a
 * verifier can sit is tried, with a verifier that replies 401 and one that throws a 401 error.
 */

const GOOD = 'good-signature'

/** Whether the request carries the signature the test's verifier accepts. */
const verified = (request: FastifyRequest): boolean => request.headers['x-signature'] === GOOD

type Refusal = 'replies' | 'throws'

/** An async hook body refusing an unverified request, by replying 401 or by throwing an error with statusCode 401. */
async function refuse (how: Refusal, request: FastifyRequest, reply: FastifyReply): Promise<unknown> {
  if (verified(request)) return undefined
  if (how === 'throws') throw Object.assign(new Error('invalid signature'), { statusCode: 401 })
  return await reply.code(401).send({ error: 'invalid signature' })
}

type Stage = 'onRequest' | 'preParsing' | 'preValidation' | 'preHandler'
const STAGES: readonly Stage[] = ['onRequest', 'preParsing', 'preValidation', 'preHandler']

/** Adds the verifier as an instance-level hook at `stage`. */
function addVerifier (app: FastifyInstance, stage: Stage, how: Refusal): void {
  if (stage === 'preParsing') {
    app.addHook('preParsing', async (request, reply, payload) => {
      await refuse(how, request, reply)
      return payload
    })
  } else {
    app.addHook(stage, async (request, reply) => { await refuse(how, request, reply) })
  }
}

/** The verifier as a route-level hook, declared in the route's options. */
function routeVerifier (stage: Stage, how: Refusal): RouteShorthandOptions {
  return stage === 'preParsing'
    ? { preParsing: async (request, reply, payload) => { await refuse(how, request, reply); return payload } }
    : { [stage]: async (request: FastifyRequest, reply: FastifyReply) => { await refuse(how, request, reply) } }
}

/** Where the verifier sits, relative to the plugin and the route. */
interface Placement {
  readonly name: string
  /** Called with the root instance before the plugin is registered. */
  readonly beforePlugin?: (app: FastifyInstance) => void
  /** Called with the instance the route is declared on, before the route. */
  readonly beforeRoute?: (app: FastifyInstance) => void
  /** Route options besides the idempotency config. */
  readonly route?: RouteShorthandOptions
  /** Called with the instance the route is declared on, after the route. */
  readonly afterRoute?: (app: FastifyInstance) => void
  /** Declare the route in an encapsulated child plugin. */
  readonly child?: boolean
}

function placements (how: Refusal): Placement[] {
  return [
    ...STAGES.map((stage) => ({ name: `instance ${stage}, registered before the plugin`, beforePlugin: (app: FastifyInstance) => { addVerifier(app, stage, how) } })),
    ...STAGES.map((stage) => ({ name: `instance ${stage}, registered after the plugin`, beforeRoute: (app: FastifyInstance) => { addVerifier(app, stage, how) } })),
    ...STAGES.map((stage) => ({ name: `route-level ${stage}, in the route's options`, route: routeVerifier(stage, how) })),
    { name: 'instance preHandler, added after the route', afterRoute: (app: FastifyInstance) => { addVerifier(app, 'preHandler', how) } },
    { name: 'preHandler of the child plugin the route is declared in', child: true, beforeRoute: (app: FastifyInstance) => { addVerifier(app, 'preHandler', how) } }
  ]
}

interface World {
  readonly app: FastifyInstance
  readonly effects: string[]
  readonly calls: () => Record<string, number>
  readonly total: () => number
}

/** POST /hook keyed by the `webhook-id` header (required), on a counting memory store, with the verifier where `placement` puts it. */
async function world (t: Test, placement: Placement): Promise<World> {
  const counted = countingStore(memoryStore({ purgeInterval: 0 }))
  const app = Fastify()
  t.teardown(async () => { await app.close(); await counted.store.close() })
  placement.beforePlugin?.(app)
  await app.register(idempotency, { store: counted.store, scope: () => 'sender' })
  const effects: string[] = []
  const routes = async (instance: FastifyInstance): Promise<void> => {
    placement.beforeRoute?.(instance)
    instance.post('/hook', {
      ...placement.route,
      config: {
        idempotency: {
          required: true,
          key: (request) => {
            const id = request.headers['webhook-id']
            return typeof id === 'string' ? id : undefined
          }
        }
      }
    }, async (request) => {
      effects.push(String(request.headers['webhook-id']))
      return { received: true }
    })
    placement.afterRoute?.(instance)
  }
  if (placement.child === true) await app.register(routes)
  else await routes(app)
  await app.ready()
  counted.reset()
  return { app, effects, calls: counted.calls, total: counted.total }
}

const deliver = (app: FastifyInstance, id: string, signature: string) => app.inject({
  method: 'POST', url: '/hook', headers: { 'content-type': 'application/json', 'webhook-id': id, 'x-signature': signature }, payload: { type: 'paid' }
})

for (const how of ['replies', 'throws'] as const) {
  for (const placement of placements(how)) {
    t.test(`a verifier that ${how === 'replies' ? 'replies' : 'throws'} 401 as ${placement.name}: the store is never asked`, async (t) => {
      const { app, effects, calls, total } = await world(t, placement)

      const forged = await deliver(app, 'evt_1', 'forged')
      t.equal(forged.statusCode, 401, forged.body)
      t.equal(forged.headers['idempotent-replayed'], undefined)
      t.same(effects, [], 'the handler never ran')
      t.equal(total(), 0, `no store call (${JSON.stringify(calls())})`)

      // The forged delivery claimed nothing: the real one with the same id runs.
      const real = await deliver(app, 'evt_1', GOOD)
      t.equal(real.statusCode, 200, real.body)
      t.same(real.json(), { received: true })
      t.same(effects, ['evt_1'], 'one effect')
      t.equal(calls().claim, 1, 'exactly one claim')

      const forgedAgain = await deliver(app, 'evt_1', 'forged')
      t.equal(forgedAgain.statusCode, 401, 'a forged copy of a recorded event is refused, not replayed')
      t.equal(calls().claim, 1, 'and asked nothing of the store')

      const redelivered = await deliver(app, 'evt_1', GOOD)
      t.equal(redelivered.statusCode, 200)
      t.equal(redelivered.headers['idempotent-replayed'], 'true')
      t.same(effects, ['evt_1'], 'still one effect')
    })
  }
}
