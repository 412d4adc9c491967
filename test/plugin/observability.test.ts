import diagnostics from 'node:diagnostics_channel'
import { Writable } from 'node:stream'
import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { DECISION_CHANNEL, InvalidOptionError, memoryStore, type DecisionEvent, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import { deferred } from '../helpers/app.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Every decision is observable three ways: a structured log line (at a level that fits it), an
 * event on the `fastify-idempotency:decision` diagnostics channel, and an OpenTelemetry-compatible
 * meter's counter and histogram.
 */

interface Recorded { name: string, value: number, attributes: Record<string, string> | undefined }

function fakeMeter (): { meter: NonNullable<IdempotencyOptions['metrics']>, added: Recorded[], recorded: Recorded[], instruments: string[] } {
  const added: Recorded[] = []
  const recorded: Recorded[] = []
  const instruments: string[] = []
  return {
    added,
    recorded,
    instruments,
    meter: {
      createCounter: (name) => { instruments.push(`counter ${name}`); return { add: (value, attributes) => { added.push({ name, value, attributes }) } } },
      createHistogram: (name, options) => { instruments.push(`histogram ${name} ${options?.unit ?? ''}`); return { record: (value, attributes) => { recorded.push({ name, value, attributes }) } } }
    }
  }
}

function logLines (): { stream: Writable, lines: Array<Record<string, any>> } {
  const lines: Array<Record<string, any>> = []
  const stream = new Writable({
    write (chunk: Buffer, _encoding, done) {
      for (const line of chunk.toString().split('\n')) if (line !== '') lines.push(JSON.parse(line))
      done()
    }
  })
  return { stream, lines }
}

async function app (t: Test, options: IdempotencyOptions, level = 'debug'): Promise<{ app: FastifyInstance, lines: Array<Record<string, any>>, gate: { hold: boolean, release: () => void } }> {
  const { stream, lines } = logLines()
  const instance = Fastify({ logger: { level, stream } })
  t.teardown(() => instance.close())
  await instance.register(idempotency, { store: memoryStore({ purgeInterval: 0 }), scope: (request) => String(request.headers['x-account'] ?? 'acct'), ...options })
  let pending = deferred()
  const gate = { hold: false, release: () => { pending.resolve(); pending = deferred() } }
  instance.post('/pay/:id', async (request, reply) => {
    if (gate.hold) await pending.promise
    if ((request.body as { fail?: string } | undefined)?.fail === 'definite') throw new Error('declined')
    if ((request.body as { fail?: string } | undefined)?.fail === 'indeterminate') { request.idempotency?.markIndeterminate(); throw new Error('unsure') }
    return reply.code(201).send({ ok: true })
  })
  return { app: instance, lines, gate }
}

const pay = (instance: FastifyInstance, key: string | null, body: unknown = { amount: 1 }, headers: Record<string, string> = {}) =>
  instance.inject({ method: 'POST', url: '/pay/42', headers: { ...(key === null ? {} : { 'idempotency-key': key }), 'x-account': 'acct_a', ...headers }, payload: body as object })

t.test('the diagnostics channel carries every decision with its request, route pattern, full key and latency', async (t) => {
  const events: DecisionEvent[] = []
  const listener = (message: unknown): void => { events.push(message as DecisionEvent) }
  diagnostics.subscribe(DECISION_CHANNEL, listener)
  t.teardown(() => { diagnostics.unsubscribe(DECISION_CHANNEL, listener) })
  const { app: instance, gate } = await app(t, { required: true })
  const longKey = '"a-rather-long-idempotency-key-0001"'

  await pay(instance, longKey)
  await pay(instance, longKey)
  await pay(instance, longKey, { amount: 2 })
  await pay(instance, null)
  await pay(instance, '"bad\\q"')
  gate.hold = true
  const first = pay(instance, '"held"')
  await sleep(20)
  await pay(instance, '"held"')
  gate.release()
  await first
  gate.hold = false
  await pay(instance, '"declined"', { fail: 'definite' })
  await pay(instance, '"unsure"', { fail: 'indeterminate' })

  t.same(events.map((event) => event.outcome), [
    'executed', 'recorded', 'replayed', 'mismatch', 'key_missing', 'key_invalid',
    'executed', 'conflict', 'recorded', 'executed', 'released', 'executed', 'held'
  ])
  const replayed = events[2] as DecisionEvent
  t.equal(replayed.key, 'a-rather-long-idempotency-key-0001', 'subscribers get the full key')
  t.equal(replayed.scope, 'acct_a')
  t.equal(replayed.route, '/pay/:id', 'the route pattern, not the URL')
  t.equal(replayed.method, 'POST')
  t.ok(replayed.durationMs >= 0 && replayed.durationMs < 10_000)
  t.equal(replayed.request?.headers['x-account'], 'acct_a', 'the request itself')
  t.ok(events.every((event) => typeof event.durationMs === 'number'))
})

t.test('an OpenTelemetry-compatible meter gets a counter and a latency histogram per outcome, without keys or scopes', async (t) => {
  const { meter, added, recorded, instruments } = fakeMeter()
  const { app: instance } = await app(t, { metrics: meter })
  await pay(instance, '"m1"')
  await pay(instance, '"m1"')
  await pay(instance, '"m1"', { amount: 3 })
  t.same(instruments, ['counter idempotency.decisions', 'histogram idempotency.decision.duration ms'])
  t.same(added.map((entry) => [entry.name, entry.value, entry.attributes]), [
    ['idempotency.decisions', 1, { outcome: 'executed', method: 'POST', route: '/pay/:id' }],
    ['idempotency.decisions', 1, { outcome: 'recorded', method: 'POST', route: '/pay/:id' }],
    ['idempotency.decisions', 1, { outcome: 'replayed', method: 'POST', route: '/pay/:id' }],
    ['idempotency.decisions', 1, { outcome: 'mismatch', method: 'POST', route: '/pay/:id' }]
  ])
  t.same(recorded.map((entry) => entry.attributes?.outcome), ['executed', 'recorded', 'replayed', 'mismatch'])
  t.ok(recorded.every((entry) => entry.name === 'idempotency.decision.duration' && entry.value >= 0))
  t.notOk(JSON.stringify([added, recorded]).includes('m1'), 'no key in any attribute (unbounded cardinality, and not for metrics backends)')
  t.notOk(JSON.stringify([added, recorded]).includes('acct_a'), 'no scope either')

  await t.rejects(async () => { await Fastify().register(idempotency, { metrics: {} as never }) }, InvalidOptionError)
  await t.rejects(async () => { await Fastify().register(idempotency, { metrics: { createCounter: () => ({ add: () => {} }) } as never }) }, { message: /option "metrics"/ })
})

t.test('log lines: one per decision at a level that fits it, key truncated, error attached', async (t) => {
  let failing = false
  const memory = memoryStore({ purgeInterval: 0 })
  const store: IdempotencyStore = { ...memory, claim: async (request) => { if (failing) throw new Error('database down'); return await memory.claim(request) } }
  const { app: instance, lines } = await app(t, { store })
  await pay(instance, '"a-rather-long-idempotency-key-0002"')
  await pay(instance, '"a-rather-long-idempotency-key-0002"')
  await pay(instance, '"a-rather-long-idempotency-key-0002"', { amount: 9 })
  failing = true
  t.equal((await pay(instance, '"down"')).statusCode, 503)
  const decisions = lines.filter((line) => line.idempotency !== undefined)
  t.same(decisions.map((line) => [line.idempotency.outcome, line.level]), [
    ['executed', 20], ['recorded', 20], ['replayed', 20], ['mismatch', 30], ['store_error', 50]
  ], 'debug for the normal path, info for client mistakes, error for store failures')
  t.ok(decisions.every((line) => line.idempotency.key === 'a-rather…' || line.idempotency.key === 'down'), 'long keys truncated in logs')
  t.equal(decisions[4]?.err?.message, 'database down')
  t.equal(decisions[0]?.idempotency.scope, 'acct_a')
})

t.test('at level info, the normal path logs nothing (and builds no log object)', async (t) => {
  const { app: instance, lines } = await app(t, {}, 'info')
  await pay(instance, '"quiet"')
  await pay(instance, '"quiet"')
  t.same(lines.filter((line) => line.idempotency !== undefined), [])
  await pay(instance, '"quiet"', { amount: 5 })
  t.same(lines.filter((line) => line.idempotency !== undefined).map((line) => line.idempotency.outcome), ['mismatch'])
})

t.test('the status route\'s store failures go through the same decision path (log and metrics)', async (t) => {
  const { meter, added } = fakeMeter()
  const memory = memoryStore({ purgeInterval: 0 })
  t.teardown(() => memory.close())
  const store: IdempotencyStore = { ...memory, get: async () => { throw new Error('database down') } }
  const { app: instance, lines } = await app(t, { store, metrics: meter, statusRoute: '/idempotency-keys/:key' })
  const res = await instance.inject({ method: 'GET', url: '/idempotency-keys/abc', headers: { 'x-account': 'acct_a' } })
  t.equal(res.statusCode, 503)
  t.same(added.map((entry) => entry.attributes), [{ outcome: 'store_error', method: 'GET', route: '/idempotency-keys/:key' }])
  const line = lines.find((entry) => entry.idempotency?.outcome === 'store_error')
  t.same([line?.level, line?.idempotency.scope, line?.idempotency.key, line?.err?.message], [50, 'acct_a', 'abc', 'database down'])
})

t.test('a logger without isLevelEnabled is called at every level; with a silent one (one no-op for every level) requests work as ever', async (t) => {
  const calls: string[] = []
  const logger = {
    fatal: () => { calls.push('fatal') },
    error: () => { calls.push('error') },
    warn: () => { calls.push('warn') },
    info: () => { calls.push('info') },
    debug: (fields: { idempotency?: { outcome?: string } }) => { calls.push(`debug ${fields.idempotency?.outcome ?? ''}`) },
    trace: () => { calls.push('trace') },
    silent: () => {},
    level: 'debug',
    child () { return this }
  }
  const app = Fastify({ loggerInstance: logger as never, disableRequestLogging: true })
  t.teardown(() => app.close())
  await app.register(idempotency, { store: memoryStore({ purgeInterval: 0 }), scope: () => 'test' })
  app.post('/pay', async () => ({ ok: true }))
  await app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': '"k"', 'content-type': 'application/json' }, payload: {} })
  t.ok(calls.includes('debug executed') && calls.includes('debug recorded'), `a custom logger got the decisions (${calls.join(', ')})`)

  // abstract-logging, Fastify's logger when logger: false: one no-op for every level.
  const noop = (): void => {}
  let built = 0
  const silent = { fatal: noop, error: noop, warn: noop, info: noop, debug: noop, trace: noop, child () { return this } }
  const quiet = Fastify({ loggerInstance: silent as never, disableRequestLogging: true })
  t.teardown(() => quiet.close())
  await quiet.register(idempotency, { store: memoryStore({ purgeInterval: 0 }), scope: () => { built++; return 'test' } })
  quiet.post('/pay', async () => ({ ok: true }))
  const answer = await quiet.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': '"k"', 'content-type': 'application/json' }, payload: {} })
  t.equal(answer.statusCode, 200, 'and it works as ever')
  t.equal(built, 1)
})
