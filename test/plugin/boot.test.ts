import cluster from 'node:cluster'
import { spawn } from 'node:child_process'
import { fileURLToPath } from 'node:url'
import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, StoreNotReadyError, UnprotectedRoutesError, type IdempotencyStore } from '../../lib/index.js'
import { keyed } from '../helpers/app.js'

/**
 * A route the plugin could not hook, a store that cannot serve, or a deployment it cannot protect,
 * must be seen with Fastify's default `logger: false`: a failed boot, or a process warning with a code.
 */

const CODES = {
  routes: 'FST_IDEMPOTENCY_UNPROTECTED_ROUTES',
  unscoped: 'FST_IDEMPOTENCY_UNSCOPED',
  memory: 'FST_IDEMPOTENCY_MEMORY_STORE',
  unchecked: 'FST_IDEMPOTENCY_STORE_UNCHECKED'
}

/** Every process warning emitted while the test runs (each app's own: nothing is deduplicated). */
function warnings (t: Test): () => Promise<Array<Error & { code?: string }>> {
  const seen: Array<Error & { code?: string }> = []
  const listener = (warning: Error & { code?: string }): void => { seen.push(warning) }
  process.on('warning', listener)
  t.teardown(() => { process.off('warning', listener) })
  // process.emitWarning emits on the next tick
  return async () => { await new Promise((resolve) => setImmediate(resolve)); return seen }
}

const withCode = (list: Array<{ code?: string }>, code: string): number => list.filter((w) => w.code === code).length

function app (t: Test): FastifyInstance {
  const instance = Fastify()
  t.teardown(() => instance.close())
  return instance
}

t.test('register without await, then a POST route: ready() fails, naming the route and the fix', async (t) => {
  const instance = app(t)
  void instance.register(idempotency, { scope: () => 'acct', required: true })
  instance.post('/payments', async () => ({ charged: true }))
  instance.get('/payments', async () => [])
  instance.post('/payments/:id/refunds', async () => ({}))
  const err = await instance.ready().then(() => null, (e: unknown) => e)
  t.type(err, UnprotectedRoutesError)
  t.match(err, { code: CODES.routes, routes: ['POST /payments', 'POST /payments/:id/refunds'] }, 'every such route, by its full path')
  t.match(String((err as Error).message), /NOT protected: POST \/payments; POST \/payments\/:id\/refunds\. Await app\.register/, 'names the route and how to fix it')
  t.notMatch(String((err as Error).message), /GET/, 'a GET is not a protected method')
})

t.test('listen() fails the same way, so the app never serves the unprotected route', async (t) => {
  const instance = app(t)
  void instance.register(idempotency, { scope: () => 'acct' })
  instance.patch('/orders/:id', async () => ({}))
  await t.rejects(instance.listen({ port: 0, host: '127.0.0.1' }), { code: CODES.routes, routes: ['PATCH /orders/:id'] })
})

t.test('a routes plugin registered before the idempotency plugin fails the boot too', async (t) => {
  const instance = app(t)
  await instance.register(async (routes) => { routes.post('/refunds', async () => ({})) })
  await instance.register(idempotency, { scope: () => 'acct' })
  await t.rejects(async () => { await instance.ready() }, { code: CODES.routes, routes: ['POST /refunds'] })
})

t.test("onEarlierRoutes: 'warn' lets the app boot with the route unprotected, and says so with a coded warning", async (t) => {
  const seen = warnings(t)
  const instance = app(t)
  void instance.register(idempotency, { scope: () => 'acct', onEarlierRoutes: 'warn' })
  let runs = 0
  instance.post('/payments', async () => ({ run: ++runs }))
  await instance.ready()
  const list = await seen()
  t.equal(withCode(list, CODES.routes), 1, 'one warning with the stable code')
  t.match(list.find((w) => w.code === CODES.routes)?.message, /POST \/payments/)
  for (let i = 0; i < 2; i++) await instance.inject({ method: 'POST', url: '/payments', headers: keyed('k'), payload: {} })
  t.equal(runs, 2, 'the route really is unprotected: what the warning says')
})

t.test('routes declared after an awaited registration boot without a warning', async (t) => {
  const seen = warnings(t)
  const instance = app(t)
  await instance.register(idempotency, { scope: () => 'acct' })
  instance.post('/payments', async () => ({}))
  await instance.ready()
  t.equal(withCode(await seen(), CODES.routes), 0)
})

t.test('inside an encapsulated context, only that context\'s earlier routes fail the boot', async (t) => {
  await t.test('another context\'s earlier POST is not this registration\'s business', async (t) => {
    const seen = warnings(t)
    const instance = app(t)
    instance.post('/login', async () => ({}))
    await instance.register(async (api) => {
      await api.register(idempotency, { scope: () => 'acct' })
      api.post('/payments', async () => ({}))
    }, { prefix: '/api' })
    await instance.ready()
    t.equal(withCode(await seen(), CODES.routes), 0, 'no warning for /login, outside the /api prefix')
  })

  await t.test('its own route declared before the registration loaded fails the boot', async (t) => {
    const instance = app(t)
    instance.post('/login', async () => ({}))
    void instance.register(async (api) => {
      void api.register(idempotency, { scope: () => 'acct' })
      api.post('/payments', async () => ({}))
    }, { prefix: '/api' })
    const err = await instance.ready().then(() => null, (e: unknown) => e)
    t.match(err, { code: CODES.routes, routes: ['POST /api/payments'] }, 'names /api/payments only')
  })

  await t.test('a child plugin of that context registered before it fails the boot too', async (t) => {
    const instance = app(t)
    await instance.register(async (api) => {
      await api.register(async (child) => { child.post('/early', async () => ({})) })
      await api.register(idempotency, { scope: () => 'acct' })
    }, { prefix: '/api' })
    await t.rejects(async () => { await instance.ready() }, { code: CODES.routes, routes: ['POST /api/early'] })
  })

  await t.test('a sibling context\'s earlier route, under no prefix, is not this registration\'s business either', async (t) => {
    const instance = app(t)
    instance.post('/webhooks', async () => ({}))
    await instance.register(async (sibling) => { sibling.post('/internal', async () => ({})) })
    await instance.register(async (api) => {
      await api.register(idempotency, { scope: () => 'acct' })
      api.post('/payments', async () => ({}))
    })
    await instance.ready()
    t.pass('boots')
  })
})

t.test('no scope: a coded process warning from every app, as well as the log line', async (t) => {
  const seen = warnings(t)
  for (let i = 0; i < 2; i++) {
    const lines: string[] = []
    const instance = Fastify({ logger: { level: 'warn', stream: { write: (line: string) => { lines.push(line) } } } })
    t.teardown(() => instance.close())
    await instance.register(idempotency)
    await instance.ready()
    t.ok(lines.some((line) => line.includes(CODES.unscoped) && line.includes('not scoped')), `app ${i + 1}: logged with the code`)
  }
  const list = await seen()
  t.equal(withCode(list, CODES.unscoped), 2, 'one warning per app, not one per process')
  t.match(list.find((w) => w.code === CODES.unscoped), { name: 'FastifyIdempotencyWarning', message: /not scoped to a principal/ })

  const scoped = app(t)
  await scoped.register(idempotency, { scope: () => 'acct' })
  await scoped.ready()
  t.equal(withCode(await seen(), CODES.unscoped), 2, 'a scoped app does not warn')
})

t.test('the memory store with NODE_ENV=production: a coded warning; a shared store: none', async (t) => {
  const seen = warnings(t)
  const before = process.env.NODE_ENV
  t.teardown(() => { if (before === undefined) delete process.env.NODE_ENV; else process.env.NODE_ENV = before })
  const boot = async (store?: IdempotencyStore): Promise<void> => {
    const instance = app(t)
    await instance.register(idempotency, { scope: () => 'acct', ...(store === undefined ? {} : { store }) })
    await instance.ready()
  }

  delete process.env.NODE_ENV
  await boot()
  t.equal(withCode(await seen(), CODES.memory), 0, 'not in development')

  process.env.NODE_ENV = 'production'
  await boot()
  t.equal(withCode(await seen(), CODES.memory), 1, 'the default store')
  const explicit = memoryStore({ purgeInterval: 0 })
  t.teardown(() => explicit.close())
  await boot(explicit)
  t.equal(withCode(await seen(), CODES.memory), 2, 'a memoryStore() passed as store')
  await boot({ ...explicit }) // another driver's object: the plugin cannot know it is process-local
  t.equal(withCode(await seen(), CODES.memory), 2, 'not for other stores')
  t.match((await seen()).find((w) => w.code === CODES.memory)?.message, /NODE_ENV=production.*this process only/s)
})

t.test('the memory store in a cluster worker: a coded warning', { skip: cluster.isWorker }, async (t) => {
  const fixture = fileURLToPath(new URL('../fixtures/cluster-worker.ts', import.meta.url))
  const out = await new Promise<{ code: number | null, stdout: string }>((resolve, reject) => {
    const child = spawn(process.execPath, ['--import', 'tsx', fixture], { stdio: ['ignore', 'pipe', 'inherit'] })
    let stdout = ''
    child.stdout.on('data', (chunk: Buffer) => { stdout += chunk.toString() })
    child.on('error', reject)
    child.on('close', (code) => resolve({ code, stdout }))
  })
  t.equal(out.code, 0, out.stdout)
  t.same(JSON.parse(out.stdout), { primary: [], worker: [CODES.memory] }, 'the worker warns, the primary (a single process) does not')
})

t.test("the store's check(): StoreNotReadyError fails the boot; any other failure boots with a coded warning; no check, nothing", async (t) => {
  const seen = warnings(t)
  const base = memoryStore({ purgeInterval: 0 })
  t.teardown(() => base.close())
  const boot = async (store: IdempotencyStore): Promise<unknown> => {
    const instance = app(t)
    await instance.register(idempotency, { scope: () => 'acct', store })
    return await instance.ready().then(() => null, (err: unknown) => err)
  }

  let checks = 0
  const notReady = await boot({ ...base, check: async () => { checks++; throw new StoreNotReadyError('the tables are missing: run migrate() before serving') } })
  t.type(notReady, StoreNotReadyError, 'ready() rejects with the store\'s error')
  t.match(notReady, { code: 'FST_IDEMPOTENCY_STORE_NOT_READY', message: 'fastify-idempotency: the tables are missing: run migrate() before serving' })
  t.equal(checks, 1, 'checked once')

  t.equal(await boot({ ...base, check: async () => { throw new Error('connect ECONNREFUSED 127.0.0.1:5432') } }), null, 'an unreachable store does not stop the boot')
  const unchecked = (await seen()).filter((w) => w.code === CODES.unchecked)
  t.equal(unchecked.length, 1, 'one coded warning')
  t.match(unchecked[0]?.message, /the store could not be checked at boot \(connect ECONNREFUSED 127\.0\.0\.1:5432\)/)

  t.equal(await boot({ ...base, check: async () => {} }), null, 'a check that resolves: the app boots')
  t.equal(await boot(base), null, 'a store without check() (the memory store): the app boots')
  t.equal(withCode(await seen(), CODES.unchecked), 1, 'and neither warns')
})
