import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import type { Test } from 'tap'
import idempotency, { InvalidOptionError, LeaseLostError, type IdempotencyOptions, type IdempotencyStore, type RecoveryTools } from '../../lib/index.js'
import { deriveKey } from '../../lib/core/derive.js'
import { customFingerprint } from '../../lib/core/fingerprint.js'
import type { Lease, StepResults } from '../../lib/core/store.js'
import { deferred } from './app.js'
import { sleep } from './sleep.js'

/**
 * Recovery points, indeterminate failures, the reconciler and the operator tools, run against one
 * store (test/plugin/recovery.test.ts: memory; test/postgres/recovery.test.ts: Postgres).
 */
export type RecoveryStore = IdempotencyStore & RecoveryTools & {
  loadSteps (lease: Lease): Promise<StepResults | null>
  saveStep (lease: Lease, name: string, resultJson: string): Promise<boolean>
  hold (lease: Lease): boolean | Promise<boolean>
}

export interface RecoveryEnvironment {
  /** A fresh, empty store. */
  readonly store: () => Promise<RecoveryStore>
  /** The plugin's lease for these tests, in ms. */
  readonly lease: number
  /** Lets more than `ms` pass on the store's clock. */
  readonly lapse: (ms: number) => Promise<void>
}

/** Every request of these tests has the same fingerprint, so a record can be forged through the store. */
const FINGERPRINT = customFingerprint('order')

interface Runs { handler: number, charge: number, email: number }

interface Harness {
  readonly app: FastifyInstance
  readonly store: RecoveryStore
  readonly runs: Runs
  /** What the next handler run does between its two steps. */
  between: (context: NonNullable<import('fastify').FastifyRequest['idempotency']>) => Promise<void> | void
  order: (key: string, scope?: string) => Promise<LightMyRequestResponse>
}

export function recoveryScenarios (t: Test, env: RecoveryEnvironment): void {
  async function harness (t: Test, options: IdempotencyOptions = {}): Promise<Harness> {
    const store = await env.store()
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, {
      store,
      scope: (request) => (request.headers['x-account'] as string | undefined) ?? 'acct_a',
      fingerprint: () => 'order',
      lease: env.lease,
      ...options
    })
    const runs: Runs = { handler: 0, charge: 0, email: 0 }
    const h: Harness = {
      app,
      store,
      runs,
      between: () => {},
      order: (key, scope = 'acct_a') => app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': `"${key}"`, 'x-account': scope } })
    }
    app.post('/orders', async (request, reply) => {
      runs.handler++
      const context = request.idempotency
      if (context === null) throw new Error('unprotected')
      const charge = await context.step('charge', async () => { runs.charge++; return { id: `ch_${runs.charge}`, providerKey: context.deriveKey('charge') } })
      await h.between(context)
      const receipt = await context.step('email', () => { runs.email++; return `sent ${runs.email}` })
      reply.code(201)
      return { charge, receipt }
    })
    return h
  }

  /** A record as a crashed owner leaves it: claimed, `steps` recorded, lease lapsed. */
  async function crashedOwner (store: RecoveryStore, key: string, steps: Record<string, unknown>, scope = 'acct_a'): Promise<Lease> {
    const claim = await store.claim({ scope, key, fingerprint: FINGERPRINT, leaseMs: env.lease, ttlMs: 86_400_000 })
    if (claim.outcome !== 'acquired') throw new Error(`forging a crashed owner: claim was ${claim.outcome}`)
    for (const [name, value] of Object.entries(steps)) {
      if (!await store.saveStep(claim.lease, name, JSON.stringify(value))) throw new Error('forging a crashed owner: saveStep failed')
    }
    await env.lapse(env.lease + 5)
    return claim.lease
  }

  t.test('deriveKey: stable per (scope, key, name), distinct otherwise, provider-safe characters', async (t) => {
    const store = await env.store()
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: (request) => request.headers['x-account'] as string })
    app.post('/derive', async (request) => ({
      charge: request.idempotency?.deriveKey('charge'),
      email: request.idempotency?.deriveKey('email')
    }))
    const derive = async (key: string, scope: string): Promise<{ charge: string, email: string }> =>
      (await app.inject({ method: 'POST', url: '/derive', headers: { 'idempotency-key': `"${key}"`, 'x-account': scope } })).json()
    const a = await derive('k1', 'acct_a')
    t.match(a.charge, /^[A-Za-z0-9_-]{43}$/, 'base64url SHA-256')
    t.not(a.charge, a.email, 'another name, another key')
    t.not((await derive('k2', 'acct_a')).charge, a.charge, 'another key, another derived key')
    t.not((await derive('k1', 'acct_b')).charge, a.charge, 'another scope, another derived key')
    // Nothing about the attempt (token, record, process) enters the derivation: any attempt, a
    // takeover or the reconciler computes the same key from the triple.
    t.equal(a.charge, deriveKey('acct_a', 'k1', 'charge'), 'a function of (scope, key, name) alone')
    // The parts are length-prefixed: moving characters between them never gives the same bytes.
    t.not(deriveKey('acct_a', 'k1c', 'harge'), a.charge, 'key/name boundary')
    t.not(deriveKey('acct_ak', '1', 'charge'), a.charge, 'scope/key boundary')
  })

  t.test('a retry after a crash between steps continues from the first incomplete step', async (t) => {
    const h = await harness(t)
    await crashedOwner(h.store, 'order-1', { charge: { id: 'ch_recorded', providerKey: 'pk' } })
    const retry = await h.order('order-1')
    t.equal(retry.statusCode, 201)
    t.same(retry.json(), { charge: { id: 'ch_recorded', providerKey: 'pk' }, receipt: 'sent 1' }, 'the recorded charge, a fresh receipt')
    t.same(h.runs, { handler: 1, charge: 0, email: 1 }, 'the completed step did not run again')
    const replay = await h.order('order-1')
    t.equal(replay.headers['idempotent-replayed'], 'true')
    t.equal(replay.body, retry.body)
    t.same(h.runs, { handler: 1, charge: 0, email: 1 })
    const record = await h.store.inspect({ scope: 'acct_a', key: 'order-1' })
    t.equal(record?.state, 'completed')
  })

  t.test('a step returns its JSON round trip, the same value on the first run and on recovery', async (t) => {
    const store = await env.store()
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'acct_a', fingerprint: () => 'order', lease: env.lease })
    let runs = 0
    app.post('/orders', async (request) => {
      const value = await request.idempotency?.step('quote', () => { runs++; return { at: new Date(0), missing: undefined, list: [1, 'two'] } })
      const nothing = await request.idempotency?.step('nothing', () => undefined)
      return { value, nothing, type: typeof (value as { at: unknown }).at }
    })
    const first = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': '"q1"' } })
    t.same(first.json(), { value: { at: '1970-01-01T00:00:00.000Z', list: [1, 'two'] }, nothing: null, type: 'string' })
    await crashedOwner(store, 'q2', { quote: { at: '1970-01-01T00:00:00.000Z', list: [1, 'two'] } }, 'acct_a')
    const recovered = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': '"q2"' } })
    t.same(recovered.json(), first.json(), 'recovered value identical to a first run')
    t.equal(runs, 1, 'the recovered step did not run')
  })

  t.test('steps of one request run one after another, in call order', async (t) => {
    const store = await env.store()
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'acct_a', lease: env.lease })
    const events: string[] = []
    app.post('/orders', async (request) => {
      const context = request.idempotency
      if (context === null) throw new Error('unprotected')
      const slow = context.step('first', async () => { events.push('first:start'); await sleep(30); events.push('first:end'); return 1 })
      const fast = context.step('second', () => { events.push('second:start'); return 2 })
      return { results: await Promise.all([slow, fast]) }
    })
    const response = await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': '"o"' } })
    t.same(response.json(), { results: [1, 2] })
    t.same(events, ['first:start', 'first:end', 'second:start'])
  })

  t.test('markIndeterminate: the key is held (409) until the reconciler completes it; then replayed', async (t) => {
    const h = await harness(t)
    h.between = (context) => { context.markIndeterminate(); throw new Error('email provider timed out') }
    const first = await h.order('ind-1')
    t.equal(first.statusCode, 500)
    const held = await h.store.inspect({ scope: 'acct_a', key: 'ind-1' })
    t.equal(held?.state, 'in_progress')
    t.equal(held?.indeterminate, true)
    const chargeKey = deriveKey('acct_a', 'ind-1', 'charge')
    t.same(held?.steps, { charge: { id: 'ch_1', providerKey: chargeKey } }, 'the step recorded what the handler returned')
    h.between = () => {}
    await env.lapse(env.lease + 5)
    const retry = await h.order('ind-1')
    t.equal(retry.statusCode, 409, 'held for reconciliation: never taken over by a retry')
    t.equal(h.runs.handler, 1)

    const seen: unknown[] = []
    const report = await h.store.reconcile({
      olderThan: 0,
      resolve: (record) => {
        seen.push({ key: record.key, indeterminate: record.indeterminate, steps: record.steps, chargeKey: record.deriveKey('charge') })
        return { action: 'complete', response: { statusCode: 201, body: { charge: record.steps.charge, receipt: 'resolved' } } }
      }
    })
    t.match(report, { examined: 1, completed: 1, released: 0, resumed: 0, left: 0, errors: [] })
    t.same(seen, [{ key: 'ind-1', indeterminate: true, steps: held?.steps, chargeKey }], 'resolve sees the steps and the same derived key the handler used')
    const replay = await h.order('ind-1')
    t.equal(replay.statusCode, 201)
    t.equal(replay.headers['idempotent-replayed'], 'true')
    t.equal(replay.headers['content-type'], 'application/json; charset=utf-8')
    t.same(replay.json(), { charge: held?.steps.charge, receipt: 'resolved' })
    t.same(h.runs, { handler: 1, charge: 1, email: 0 }, 'nothing ran again')
  })

  t.test('default classification: a failure after a step completed is indeterminate, before any step definite', async (t) => {
    const h = await harness(t)
    h.between = () => { throw new Error('boom after the charge') }
    t.equal((await h.order('after-step')).statusCode, 500)
    t.equal((await h.store.inspect({ scope: 'acct_a', key: 'after-step' }))?.indeterminate, true, 'held')
    t.equal((await h.order('after-step')).statusCode, 409)

    const app = Fastify()
    t.teardown(() => app.close())
    let runs = 0
    await app.register(idempotency, { store: h.store, scope: () => 'acct_a', lease: env.lease })
    app.post('/early', async () => { runs++; if (runs === 1) throw new Error('validation failed upstream'); return { ok: runs } })
    const early = () => app.inject({ method: 'POST', url: '/early', headers: { 'idempotency-key': '"early"' } })
    t.equal((await early()).statusCode, 500)
    t.equal(await h.store.inspect({ scope: 'acct_a', key: 'early' }), null, 'released')
    const retried = await early()
    t.same([retried.statusCode, retried.json(), runs], [200, { ok: 2 }, 2], 'a retry executes again')
  })

  t.test('markDefinite after a step: released with its steps; a retry starts from the beginning', async (t) => {
    const h = await harness(t)
    h.between = (context) => { context.markDefinite(); throw new Error('card declined: nothing happened') }
    t.equal((await h.order('def-1')).statusCode, 500)
    t.equal(await h.store.inspect({ scope: 'acct_a', key: 'def-1' }), null)
    h.between = () => {}
    const retry = await h.order('def-1')
    t.equal(retry.statusCode, 201)
    t.same(h.runs, { handler: 2, charge: 2, email: 1 })
  })

  t.test('a 5xx answered without throwing follows the same rule', async (t) => {
    const store = await env.store()
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'acct_a', lease: env.lease })
    app.post('/orders', async (request, reply) => {
      await request.idempotency?.step('charge', () => 'ch')
      return reply.code(502).send({ error: 'email provider unreachable' })
    })
    t.equal((await app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': '"five"' } })).statusCode, 502)
    t.equal((await store.inspect({ scope: 'acct_a', key: 'five' }))?.indeterminate, true)
  })

  t.test('reconcile: release lets a retry run afresh; resume lets it continue from its steps; leave keeps the 409', async (t) => {
    const h = await harness(t)
    h.between = (context) => { context.markIndeterminate(); throw new Error('unsure') }
    for (const key of ['rel', 'res', 'lea']) t.equal((await h.order(key)).statusCode, 500)
    h.between = () => {}
    const actions: Record<string, 'release' | 'resume' | 'leave'> = { rel: 'release', res: 'resume', lea: 'leave' }
    await env.lapse(5)
    const report = await h.store.reconcile({ olderThan: 0, resolve: (record) => ({ action: actions[record.key] ?? 'leave' }) })
    t.match(report, { examined: 3, completed: 0, released: 1, resumed: 1, left: 1, errors: [] })
    t.same(h.runs, { handler: 3, charge: 3, email: 0 })

    const released = await h.order('rel')
    t.equal(released.statusCode, 201)
    t.same(h.runs, { handler: 4, charge: 4, email: 1 }, 'released: the charge step ran again')
    const resumed = await h.order('res')
    t.equal(resumed.statusCode, 201)
    t.same(h.runs, { handler: 5, charge: 4, email: 2 }, 'resumed: the charge step did not run again')
    t.equal((resumed.json() as { charge: { id: string } }).charge.id, 'ch_2', 'the recorded charge of the first attempt')
    t.equal((await h.order('lea')).statusCode, 409, 'left: still held')
    t.equal((await h.store.inspect({ scope: 'acct_a', key: 'lea' }))?.indeterminate, true, 'left as it was: indeterminate')
  })

  t.test('reconcile: olderThan spares recent records; a crashed owner is reconciled too; resolve errors leave the record', async (t) => {
    const h = await harness(t)
    await crashedOwner(h.store, 'crashed', { charge: { id: 'ch_x' } })
    const none = await h.store.reconcile({ olderThan: 3_600_000, resolve: () => { throw new Error('must not be called') } })
    t.match(none, { examined: 0 })
    const failing = await h.store.reconcile({ olderThan: 0, resolve: () => { throw new Error('provider lookup failed') } })
    t.equal(failing.examined, 1)
    t.equal(failing.errors.length, 1)
    t.match(failing.errors[0], { scope: 'acct_a', key: 'crashed' })
    const after = await h.store.inspect({ scope: 'acct_a', key: 'crashed' })
    t.same([after?.state, after?.indeterminate, after?.leaseRemainingMs], ['in_progress', false, 0], 'given back as it was, takeable')
    const seen: boolean[] = []
    const report = await h.store.reconcile({ olderThan: 0, resolve: (record) => { seen.push(record.indeterminate); return { action: 'complete', response: { statusCode: 200, body: 'done', headers: { 'X-Resolved': 'yes' } } } } })
    t.match(report, { examined: 1, completed: 1 })
    t.same(seen, [false], 'not declared indeterminate: its owner vanished')
    const replay = await h.order('crashed')
    t.same([replay.statusCode, replay.body, replay.headers['content-type']], [200, 'done', 'text/plain; charset=utf-8'])
    t.equal(h.runs.handler, 0)
    await t.rejects(h.store.reconcile({ olderThan: 0 } as never), InvalidOptionError, 'resolve is required')
    await t.rejects(h.store.reconcile({ olderThan: -1, resolve: () => undefined }), { name: 'InvalidOptionError', message: /olderThan/ })
  })

  t.test('a completed record is never reconciled, and a record a retry took over is not either', async (t) => {
    const h = await harness(t)
    t.equal((await h.order('done')).statusCode, 201)
    await crashedOwner(h.store, 'taken', { charge: { id: 'ch_t' } })
    t.equal((await h.order('taken')).statusCode, 201, 'the retry took it over and finished')
    const report = await h.store.reconcile({ olderThan: 0, resolve: () => { throw new Error('must not be called') } })
    t.match(report, { examined: 0, errors: [] })
  })

  t.test('forceRelease of a running key: the owner loses its lease (LeaseLostError), a retry runs afresh', async (t) => {
    const h = await harness(t)
    const paused = deferred()
    const reached = deferred()
    let caught: unknown = null
    h.between = async () => { reached.resolve(); await paused.promise }
    h.app.setErrorHandler((error, _request, reply) => { caught = error; return reply.code(500).send({ error: (error as Error).name }) })
    const first = h.order('forced')
    await reached.promise
    t.equal(await h.store.forceRelease({ scope: 'acct_b', key: 'forced' }), false, 'scoped: another principal cannot release it')
    t.equal(await h.store.forceRelease({ scope: 'acct_a', key: 'forced' }), true)
    t.equal(await h.store.forceRelease({ scope: 'acct_a', key: 'forced' }), false, 'nothing left to release')
    h.between = () => {}
    paused.resolve()
    t.equal((await first).statusCode, 500)
    t.ok(caught instanceof LeaseLostError, 'the step after the release was refused')
    t.same(h.runs, { handler: 1, charge: 1, email: 0 }, 'the released owner never ran its next step')
    const retry = await h.order('forced')
    t.equal(retry.statusCode, 201)
    t.same(h.runs, { handler: 2, charge: 2, email: 1 }, 'only the retry, the key\'s owner now, sent the email')
  })

  t.test('inspect: scoped, and shows a completed record\'s response', async (t) => {
    const h = await harness(t)
    await h.order('seen')
    const record = await h.store.inspect({ scope: 'acct_a', key: 'seen' })
    t.equal(record?.state, 'completed')
    t.equal(record?.response?.statusCode, 201)
    t.same(JSON.parse(String(record?.response?.body)), { charge: { id: 'ch_1', providerKey: deriveKey('acct_a', 'seen', 'charge') }, receipt: 'sent 1' })
    t.equal(await h.store.inspect({ scope: 'acct_b', key: 'seen' }), null)
    t.equal(await h.store.inspect({ scope: 'acct_a', key: 'never' }), null)
  })

  t.test('startReconciler: resolves stuck records on its own, stop() waits for the pass in flight', async (t) => {
    const h = await harness(t)
    h.between = (context) => { context.markIndeterminate(); throw new Error('unsure') }
    await h.order('auto')
    const reports: number[] = []
    const reconciler = h.store.startReconciler({
      interval: 10,
      olderThan: 0,
      resolve: () => ({ action: 'complete', response: { statusCode: 201, body: { resolved: true } } }),
      onReport: (report) => { reports.push(report.completed) }
    })
    const deadline = Date.now() + 5000
    while ((await h.store.inspect({ scope: 'acct_a', key: 'auto' }))?.state !== 'completed' && Date.now() < deadline) {
      await sleep(10)
    }
    await reconciler.stop()
    t.equal((await h.store.inspect({ scope: 'acct_a', key: 'auto' }))?.state, 'completed')
    t.ok(reports.includes(1), 'a pass reported the completion')
    t.same((await h.order('auto')).json(), { resolved: true })
    t.throws(() => h.store.startReconciler({ interval: 0, resolve: () => undefined }), { name: 'InvalidOptionError', message: /interval/ })
  })
}
