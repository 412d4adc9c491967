import { createHmac, randomBytes } from 'node:crypto'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { pathToFileURL } from 'node:url'
import Fastify, { type FastifyInstance, type FastifyPluginAsync, type FastifyRequest, type LightMyRequestResponse } from 'fastify'
import postgres from 'postgres'
import Stripe from 'stripe'
import { Webhook } from 'standardwebhooks'
import t, { type Test } from 'tap'
import ts from 'typescript'
import idempotency, { memoryStore, type DecisionEvent, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { deferred, PROBLEM_TYPE } from '../helpers/app.js'
import { codeBlocks, ROOT } from '../helpers/markdown.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'
import { countingStore, type CountingStore } from './counting-store.js'
import { closedPort } from '../helpers/closed-port.js'

/**
 * The webhook recipes of docs/webhooks.md (Stripe, Standard Webhooks, GitHub) and its 422 alert,
 * run as written: the page's own ```ts blocks, transpiled and imported (so a test cannot drift
 * from the page; test/docs/docs.test.ts type-checks the same blocks), verifying real signatures with
 * the real `stripe` and `standardwebhooks` packages. Each recipe runs on the memory store, and on
 * PostgreSQL (DATABASE_URL) in lease mode and in atomic mode (the effect written through
 * `request.idempotency.sql`, so it commits with the event's record).
 *
 * The alert block imports `fastify-idempotency` itself: the package resolves to its own build
 * (dist/, which scripts/test.mjs builds first), and the diagnostics channel is one by name.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/webhooks/recipes.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

/** The ```ts block under a heading of docs/webhooks.md. */
function blockUnder (heading: string): string {
  const block = codeBlocks('docs/webhooks.md').find((b) => b.lang === 'ts' && b.heading === heading)
  if (block === undefined) throw new Error(`docs/webhooks.md has no \`\`\`ts block under "${heading}"`)
  return block.code
}

// ---------------------------------------------------------------------------------------------
// The recipes, as the tests drive them
// ---------------------------------------------------------------------------------------------

/** What the test's effect is told about a delivery: the request, and the id it is keyed by. */
type Effect = (request: FastifyRequest, id: string) => Promise<void>

interface Delivery { readonly headers: Record<string, string>, readonly payload: string }

interface Recipe {
  readonly name: string
  readonly url: string
  /** The scope the recipe gives this test's deliveries. */
  readonly scope: string
  /** Registers the docs' plugin on `app`, its `handle` calling `effect`. */
  register (app: FastifyInstance, effect: Effect): Promise<void>
  /** A delivery of event `id` with `data`, signed with the endpoint's secret, or `forged` (another secret). */
  delivery (id: string, data: Record<string, unknown>, forged?: boolean): Delivery
}

interface StripeModule { stripeWebhooks: FastifyPluginAsync<{ stripe: Stripe, secret: string, handle: (event: Stripe.Event, request: FastifyRequest) => Promise<void> }> }
interface StandardModule { standardWebhooks: FastifyPluginAsync<{ secret: string, sender: string, handle: (payload: unknown, request: FastifyRequest) => Promise<void> }> }
interface GitHubModule { githubWebhooks: FastifyPluginAsync<{ secret: string, handle: (event: string, payload: unknown, request: FastifyRequest) => Promise<void> }> }
interface AlertModule { alertOnMismatch: (alert: (decision: DecisionEvent) => void) => () => void }

const stripe = new Stripe('sk_test_recipes')
const STRIPE_SECRET = `whsec_${randomBytes(16).toString('hex')}`
const STANDARD_SECRET = `whsec_${randomBytes(24).toString('base64')}`
const GITHUB_SECRET = randomBytes(20).toString('hex')
const OTHER = 'another-secret'

function recipes (stripeModule: StripeModule, standardModule: StandardModule, githubModule: GitHubModule): Recipe[] {
  const json = { 'content-type': 'application/json' }
  return [{
    name: 'Stripe',
    url: '/stripe',
    scope: 'acct_1Connected',
    register: async (app, effect) => {
      await app.register(stripeModule.stripeWebhooks, { stripe, secret: STRIPE_SECRET, handle: async (event, request) => { await effect(request, event.id) } })
    },
    delivery: (id, data, forged = false) => {
      const payload = JSON.stringify({ id, object: 'event', type: 'checkout.session.completed', account: 'acct_1Connected', data: { object: data } })
      const signature = stripe.webhooks.generateTestHeaderString({ payload, secret: forged ? `whsec_${OTHER}` : STRIPE_SECRET })
      return { headers: { ...json, 'stripe-signature': signature }, payload }
    }
  }, {
    name: 'Standard Webhooks',
    url: '/standard',
    scope: 'billing',
    register: async (app, effect) => {
      await app.register(standardModule.standardWebhooks, {
        secret: STANDARD_SECRET,
        sender: 'billing',
        handle: async (_payload, request) => { await effect(request, String(request.headers['webhook-id'])) }
      })
    },
    delivery: (id, data, forged = false) => {
      const payload = JSON.stringify({ type: 'invoice.paid', data })
      const now = new Date()
      const signer = new Webhook(forged ? `whsec_${Buffer.from(OTHER).toString('base64')}` : STANDARD_SECRET)
      return {
        headers: { ...json, 'webhook-id': id, 'webhook-timestamp': String(Math.floor(now.getTime() / 1000)), 'webhook-signature': signer.sign(id, now, payload) },
        payload
      }
    }
  }, {
    name: 'GitHub',
    url: '/github',
    scope: 'github',
    register: async (app, effect) => {
      await app.register(githubModule.githubWebhooks, {
        secret: GITHUB_SECRET,
        handle: async (_event, _payload, request) => { await effect(request, String(request.headers['x-github-delivery'])) }
      })
    },
    delivery: (id, data, forged = false) => {
      const payload = JSON.stringify({ action: 'opened', ...data })
      const signature = `sha256=${createHmac('sha256', forged ? OTHER : GITHUB_SECRET).update(payload).digest('hex')}`
      return { headers: { ...json, 'x-github-delivery': id, 'x-github-event': 'pull_request', 'x-hub-signature-256': signature }, payload }
    }
  }]
}

// ---------------------------------------------------------------------------------------------
// The stores
// ---------------------------------------------------------------------------------------------

/** Where the effects and records go. */
interface World {
  readonly name: string
  /** The plugin's options besides the store. */
  readonly plugin: IdempotencyOptions
  /** A store for one test (fresh, or a shared one), closed by the world. */
  store (t: Test): IdempotencyStore
  /** A store that cannot be reached, in the same mode. */
  broken (t: Test): IdempotencyStore
  /** The effect of a delivery: an array entry, or a row (through the request's transaction in atomic mode). */
  write (request: FastifyRequest, id: string): Promise<void>
  /** The effects event `id` left. */
  effects (id: string): Promise<number>
  /** The states of the store's records of `id` (PostgreSQL only; null on the memory store). */
  records (id: string): Promise<string[] | null>
}

function memoryWorld (): World {
  const effects = new Map<string, number>()
  return {
    name: 'memory store',
    plugin: {},
    store: (t) => {
      const store = memoryStore({ purgeInterval: 0 })
      t.teardown(() => store.close())
      return store
    },
    broken: (t) => {
      const base = memoryStore({ purgeInterval: 0 })
      t.teardown(() => base.close())
      return { ...base, claim: async () => { throw new Error('connection refused') } }
    },
    write: async (_request, id) => { effects.set(id, (effects.get(id) ?? 0) + 1) },
    effects: async (id) => effects.get(id) ?? 0,
    records: async () => null
  }
}

function postgresWorlds (url: string): World[] {
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_webhooks',
    client: { max: 2 },
    migrate: ['records'],
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.effects (id serial PRIMARY KEY, event text NOT NULL)`
  })
  const sql = postgres(url, { max: 6, onnotice: () => {} })
  const stores: PostgresStore[] = []
  t.teardown(async () => {
    for (const store of stores) await store.close()
    await sql.end({ timeout: 2 })
  })
  const shared = (): PostgresStore => {
    const store = postgresStore({ sql, schema, table: 'records', purgeInterval: 0 })
    stores.push(store)
    return store
  }
  let port = 0
  t.before(async () => { port = await closedPort() })
  const broken = (t: Test): IdempotencyStore => {
    // The client connects on its first query, made by the test (after the port was found).
    const client = postgres({ host: '127.0.0.1', port, database: 'none', username: 'none', connect_timeout: 2, max: 1, onnotice: () => {} })
    const store = postgresStore({ sql: client, purgeInterval: 0 })
    t.teardown(async () => {
      await store.close()
      await client.end({ timeout: 1 })
    })
    return store
  }
  const effects = async (id: string): Promise<number> =>
    Number((await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.effects WHERE event = ${id}`)[0]?.n)
  const records = async (id: string): Promise<string[]> =>
    (await admin`SELECT state FROM ${admin(schema)}.records WHERE key = ${id}`).map((row) => String(row.state))
  const insert = `INSERT INTO "${schema}".effects (event) VALUES ($1)`
  const lease = shared()
  const atomic = shared()
  return [{
    name: 'PostgreSQL, lease mode',
    plugin: {},
    store: () => lease,
    broken,
    // Lease mode: the effect is written on its own (the record settles after the handler).
    write: async (_request, id) => { await sql.unsafe(insert, [id]) },
    effects,
    records
  }, {
    name: 'PostgreSQL, atomic mode',
    plugin: { transaction: true },
    store: () => atomic,
    broken,
    // Atomic mode: through the request's transaction, committed with the event's record.
    write: async (request, id) => {
      const tx = request.idempotency?.sql
      if (tx === undefined) throw new Error('no request.idempotency.sql: the route is not in atomic mode')
      await tx.unsafe(insert, [id])
    },
    effects,
    records
  }]
}

// ---------------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------------

function suite (url: string): void {
  const modules = mkdtempSync(path.join(ROOT, 'test', 'webhooks', '.recipes-'))
  t.teardown(() => { rmSync(modules, { recursive: true, force: true }) })

  /** Transpiles the block under `heading` and imports it (types erased, as tsx or tsc would). */
  async function load<T> (heading: string): Promise<T> {
    const js = ts.transpileModule(blockUnder(heading), { compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022 } }).outputText
    const file = path.join(modules, `${heading.replace(/\W+/g, '-').toLowerCase()}.mjs`)
    writeFileSync(file, js)
    return await import(pathToFileURL(file).href) as T
  }

  const worlds = [memoryWorld(), ...postgresWorlds(url)]
  const fresh = (): string => `evt_${randomBytes(8).toString('hex')}`

  t.test('the recipes', async (t) => {
    const all = recipes(await load<StripeModule>('Stripe'), await load<StandardModule>('Standard Webhooks'), await load<GitHubModule>('GitHub'))
    const { alertOnMismatch } = await load<AlertModule>('What each answer means to the sender')

    for (const recipe of all) {
      for (const world of worlds) {
        const name = `${recipe.name}, ${world.name}`

        /** An app with the plugin on a counting store and the recipe's route; `effect` wraps the world's write. */
        async function app (t: Test, options: { store?: IdempotencyStore, plugin?: IdempotencyOptions, effect?: Effect } = {}): Promise<{ app: FastifyInstance, counted: CountingStore<IdempotencyStore> }> {
          const counted = countingStore(options.store ?? world.store(t))
          const instance = Fastify()
          t.teardown(() => instance.close())
          await instance.register(idempotency, { store: counted.store, ...world.plugin, ...options.plugin })
          await recipe.register(instance, options.effect ?? world.write)
          await instance.ready()
          counted.reset()
          return { app: instance, counted }
        }
        const send = (app: FastifyInstance, delivery: Delivery): Promise<LightMyRequestResponse> =>
          app.inject({ method: 'POST', url: recipe.url, headers: delivery.headers, payload: delivery.payload })

        t.test(`${name}: the first delivery runs the effect once; a redelivery gets the recorded 200, replayed`, async (t) => {
          const { app: instance, counted } = await app(t)
          const id = fresh()
          const first = await send(instance, recipe.delivery(id, { order: 'ord_1' }))
          t.equal(first.statusCode, 200, first.body)
          t.same(first.json(), { received: true })
          t.equal(first.headers['idempotent-replayed'], undefined)
          t.equal(await world.effects(id), 1, 'one effect')
          // The sender signs each delivery afresh (a new timestamp); the body is the same.
          const again = await send(instance, recipe.delivery(id, { order: 'ord_1' }))
          t.equal(again.statusCode, 200)
          t.equal(again.headers['idempotent-replayed'], 'true')
          t.equal(again.body, first.body, 'the recorded answer, byte for byte')
          t.equal(await world.effects(id), 1, 'no second effect')
          const claims = (counted.calls().claim ?? 0) + (counted.calls().claimInTransaction ?? 0)
          t.equal(claims, 2, `both deliveries were claimed once each: one ran, one replayed (${JSON.stringify(counted.calls())})`)
          const rows = await world.records(id)
          if (rows !== null) t.same(rows, ['completed'], 'one record, completed')
        })

        t.test(`${name}: the same id with a different, correctly signed body is a 422 problem and a mismatch decision`, async (t) => {
          const { app: instance } = await app(t)
          const alerts: DecisionEvent[] = []
          const unsubscribe = alertOnMismatch((decision) => { alerts.push(decision) })
          t.teardown(unsubscribe)
          const id = fresh()
          t.equal((await send(instance, recipe.delivery(id, { amount: 100 }))).statusCode, 200)
          const changed = await send(instance, recipe.delivery(id, { amount: 999 }))
          t.equal(changed.statusCode, 422, changed.body)
          t.match(String(changed.headers['content-type']), /^application\/problem\+json/)
          t.match(changed.json(), { type: PROBLEM_TYPE('key-reused'), status: 422 })
          t.equal(await world.effects(id), 1, 'the first body\'s effect only')
          const mine = alerts.filter((decision) => decision.key === id)
          t.equal(mine.length, 1, 'one mismatch decision on the diagnostics channel, through the docs\' alertOnMismatch')
          t.match(mine[0], { outcome: 'mismatch', key: id, scope: recipe.scope, method: 'POST', route: recipe.url })
          t.equal(mine[0]?.request?.headers['content-type'], 'application/json', 'with the request')
        })

        t.test(`${name}: a bad signature is 401, and the store saw no call`, async (t) => {
          const { app: instance, counted } = await app(t)
          const id = fresh()
          const forged = await send(instance, recipe.delivery(id, { amount: 1 }, true))
          t.equal(forged.statusCode, 401, forged.body)
          t.same(forged.json(), { error: 'invalid signature' })
          t.equal(counted.total(), 0, `no store call (${JSON.stringify(counted.calls())})`)
          t.equal(await world.effects(id), 0)
          const rows = await world.records(id)
          if (rows !== null) t.same(rows, [], 'no record')
          // The forged delivery claimed nothing: the real one runs.
          const real = await send(instance, recipe.delivery(id, { amount: 1 }))
          t.equal(real.statusCode, 200, real.body)
          t.equal(real.headers['idempotent-replayed'], undefined)
          t.equal(await world.effects(id), 1)
        })

        t.test(`${name}: two deliveries of one event at once run the effect once; the second gets 409`, async (t) => {
          const started = deferred()
          const gate = deferred()
          const { app: instance } = await app(t, { effect: async (request, id) => { started.resolve(); await gate.promise; await world.write(request, id) } })
          const id = fresh()
          const first = send(instance, recipe.delivery(id, { amount: 5 }))
          await started.promise
          const second = await send(instance, recipe.delivery(id, { amount: 5 }))
          t.equal(second.statusCode, 409, second.body)
          t.match(second.json(), { type: PROBLEM_TYPE('request-in-progress'), status: 409 })
          t.ok(second.headers['retry-after'], 'with Retry-After')
          gate.resolve()
          t.equal((await first).statusCode, 200)
          t.equal(await world.effects(id), 1, 'one effect')
          const later = await send(instance, recipe.delivery(id, { amount: 5 }))
          t.equal(later.headers['idempotent-replayed'], 'true', 'the sender\'s retry of the 409 gets the replay')
          t.equal(await world.effects(id), 1)
        })

        t.test(`${name}: with wait, the second of two deliveries at once waits and gets the replay`, async (t) => {
          const started = deferred()
          const gate = deferred()
          let entered = 0
          const { app: instance } = await app(t, {
            plugin: { wait: 10_000 },
            effect: async (request, id) => { entered++; started.resolve(); await gate.promise; await world.write(request, id) }
          })
          const id = fresh()
          const first = send(instance, recipe.delivery(id, { amount: 6 }))
          await started.promise
          const second = send(instance, recipe.delivery(id, { amount: 6 }))
          // Long enough for the second to have been claimed and be waiting (it cannot run: one effect below).
          await sleep(150)
          gate.resolve()
          const [a, b] = await Promise.all([first, second])
          t.equal(a.statusCode, 200)
          t.equal(b.statusCode, 200, b.body)
          t.equal(b.headers['idempotent-replayed'], 'true', 'the replay, not a 409')
          t.equal(b.body, a.body)
          t.equal(entered, 1, 'the handler ran once')
          t.equal(await world.effects(id), 1, 'one effect')
        })

        t.test(`${name}: a store that cannot be reached is a 503 problem, and the effect does not run`, async (t) => {
          let ran = 0
          const { app: instance } = await app(t, { store: world.broken(t), effect: async (request, id) => { ran++; await world.write(request, id) } })
          const id = fresh()
          const res = await send(instance, recipe.delivery(id, { amount: 7 }))
          t.equal(res.statusCode, 503, res.body)
          t.match(String(res.headers['content-type']), /^application\/problem\+json/)
          t.match(res.json(), { type: PROBLEM_TYPE('store-unavailable'), status: 503 })
          t.equal(ran, 0, 'the handler did not run')
          t.equal(await world.effects(id), 0, 'no effect')
        })

        t.test(`${name}: an effect that fails answers 500 and records nothing; the redelivery runs it`, async (t) => {
          let failing = true
          const { app: instance } = await app(t, {
            effect: async (request, id) => {
              if (failing) throw new Error('the warehouse is down')
              await world.write(request, id)
            }
          })
          const id = fresh()
          const failed = await send(instance, recipe.delivery(id, { amount: 8 }))
          t.equal(failed.statusCode, 500)
          t.equal(await world.effects(id), 0)
          failing = false
          const redelivered = await send(instance, recipe.delivery(id, { amount: 8 }))
          t.equal(redelivered.statusCode, 200, redelivered.body)
          t.equal(redelivered.headers['idempotent-replayed'], undefined, 'it ran: the failure was not recorded')
          t.equal(await world.effects(id), 1)
        })
      }

      t.test(`${recipe.name}, PostgreSQL, atomic mode: an effect written before the handler fails is rolled back with the claim`, async (t) => {
        const world = worlds.find((w) => w.name === 'PostgreSQL, atomic mode')
        if (world === undefined) return t.fail('the atomic world exists')
        let failing = true
        const instance = Fastify()
        t.teardown(() => instance.close())
        await instance.register(idempotency, { store: world.store(t), ...world.plugin })
        await recipe.register(instance, async (request, id) => {
          await world.write(request, id)
          if (failing) throw new Error('after the write')
        })
        const id = fresh()
        const send = (): Promise<LightMyRequestResponse> => {
          const delivery = recipe.delivery(id, { amount: 9 })
          return instance.inject({ method: 'POST', url: recipe.url, headers: delivery.headers, payload: delivery.payload })
        }
        t.equal((await send()).statusCode, 500)
        t.equal(await world.effects(id), 0, 'the row rolled back with the claim')
        t.same(await world.records(id), [], 'no record: the event is free')
        failing = false
        t.equal((await send()).statusCode, 200)
        t.equal((await send()).headers['idempotent-replayed'], 'true')
        t.equal(await world.effects(id), 1, 'one row, committed with its record')
        t.same(await world.records(id), ['completed'])
      })
    }
  })

  t.test('Stripe: the scope is the event\'s connected account, or platform for the platform\'s own events', async (t) => {
    const { stripeWebhooks } = await load<StripeModule>('Stripe')
    const store = memoryStore({ purgeInterval: 0 })
    t.teardown(() => store.close())
    const instance = Fastify()
    t.teardown(() => instance.close())
    await instance.register(idempotency, { store })
    const seen: Array<{ id: string, scope: string | undefined }> = []
    await instance.register(stripeWebhooks, {
      stripe,
      secret: STRIPE_SECRET,
      handle: async (event, request) => { seen.push({ id: event.id, scope: request.idempotency?.scope }) }
    })
    const send = (account: string | null): Promise<LightMyRequestResponse> => {
      const payload = JSON.stringify({ id: 'evt_same', object: 'event', type: 'charge.succeeded', ...(account === null ? {} : { account }), data: { object: {} } })
      return instance.inject({ method: 'POST', url: '/stripe', headers: { 'content-type': 'application/json', 'stripe-signature': stripe.webhooks.generateTestHeaderString({ payload, secret: STRIPE_SECRET }) }, payload })
    }
    t.equal((await send(null)).statusCode, 200)
    t.equal((await send('acct_A')).statusCode, 200)
    t.equal((await send('acct_A')).headers['idempotent-replayed'], 'true')
    t.same(seen, [{ id: 'evt_same', scope: 'platform' }, { id: 'evt_same', scope: 'acct_A' }], 'one execution per scope')
  })

  t.test('the recipes\' raw-body parser stays inside their plugin: a JSON route beside them still gets a parsed body', async (t) => {
    const { githubWebhooks } = await load<GitHubModule>('GitHub')
    const instance = Fastify()
    t.teardown(() => instance.close())
    await instance.register(idempotency, { store: memoryStore({ purgeInterval: 0 }), scope: () => 'api' })
    await instance.register(githubWebhooks, { secret: GITHUB_SECRET, handle: async () => {} })
    instance.post('/orders', async (request) => ({ parsed: !Buffer.isBuffer(request.body), body: request.body }))
    const res = await instance.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': '"k"' }, payload: { item: 'a' } })
    t.same(res.json(), { parsed: true, body: { item: 'a' } })
  })
}
