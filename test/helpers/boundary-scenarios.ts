import http from 'node:http'
import type { AddressInfo } from 'node:net'
import { Readable } from 'node:stream'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import type { Test } from 'tap'
import idempotency, { LeaseLostError, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import type { StoredRecord } from '../../lib/core/store.js'
import { deferred, eventually, keyed, PROBLEM_TYPE } from './app.js'
import { sleep } from './sleep.js'
import type { RecoveryStore } from './recovery-scenarios.js'

/**
 * The lease boundaries where a second execution used to slip in, run against one store
 * (test/lease/boundaries.test.ts: memory; test/postgres/boundaries.test.ts: Postgres), in
 * real time. The rule they all check: a live owner keeps its key until its outcome is recorded, so
 * a retry that arrives meanwhile gets 409 (or waits), never a second execution.
 *
 * Times are multiples of the lease (300 ms) with wide margins: a check "at 2 leases" holds when the
 * owner renews at all, and fails by a whole lease when it does not.
 */

export interface BoundaryEnvironment {
  /** A fresh, empty store. */
  readonly store: () => Promise<RecoveryStore>
}

const LEASE = 300
const SCOPE = 'acct_a'

interface World {
  readonly app: FastifyInstance
  readonly store: IdempotencyStore & Partial<RecoveryStore>
  readonly post: (url: string, key: string) => Promise<LightMyRequestResponse>
  readonly record: (key: string) => Promise<StoredRecord | null>
  readonly listen: () => Promise<number>
}

const typeOf = (res: LightMyRequestResponse): string => (JSON.parse(res.body) as { type?: string }).type ?? ''

export function boundaryScenarios (t: Test, env: BoundaryEnvironment): void {
  async function world (t: Test, wrap: (store: RecoveryStore) => IdempotencyStore = (store) => store, options: IdempotencyOptions = {}): Promise<World> {
    const inner = await env.store()
    const store = wrap(inner)
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => SCOPE, lease: LEASE, ...options })
    return {
      app,
      store,
      post: (url, key) => app.inject({ method: 'POST', url, headers: keyed(key), payload: { amount: 100 } }),
      record: (key) => inner.get({ scope: SCOPE, key }),
      listen: async () => {
        await app.listen({ host: '127.0.0.1', port: 0 })
        return (app.server.address() as AddressInfo).port
      }
    }
  }

  t.test('case 1: a client that leaves mid-handler changes nothing: retries get 409, the handler runs once, its outcome is replayed', async (t) => {
    const w = await world(t)
    let runs = 0
    w.app.post('/pay', async (_request, reply) => {
      const run = ++runs
      await sleep(1500)
      return reply.code(201).send({ id: `ch_${run}` })
    })
    const port = await w.listen()
    const startedAt = Date.now()
    const client = http.request({ host: '127.0.0.1', port, method: 'POST', path: '/pay', agent: false, headers: keyed('leave') })
    client.on('error', () => {})
    client.end(JSON.stringify({ amount: 100 }))
    await sleep(200)
    client.destroy()

    await sleep(800 - (Date.now() - startedAt))
    const retry = await w.post('/pay', 'leave')
    t.equal(retry.statusCode, 409, 'the retry at 800 ms gets 409')
    t.equal(typeOf(retry), PROBLEM_TYPE('request-in-progress'))
    t.equal(runs, 1, 'and does not run the handler')
    t.ok(await eventually(async () => (await w.record('leave'))?.state === 'completed'), 'the departed client\'s outcome is recorded')
    const replay = await w.post('/pay', 'leave')
    t.equal(replay.headers['idempotent-replayed'], 'true')
    t.same(replay.json(), { id: 'ch_1' })
    t.equal(runs, 1)
  })

  t.test('case 2: a streamed answer longer than the lease keeps its key until its end is recorded', async (t) => {
    const w = await world(t)
    let runs = 0
    w.app.post('/stream', async (_request, reply) => {
      runs++
      reply.code(201).type('text/plain')
      async function * chunks (): AsyncGenerator<string> {
        for (let i = 0; i < 10; i++) {
          await sleep(100)
          yield `chunk-${i};`
        }
      }
      return Readable.from(chunks())
    })
    const startedAt = Date.now()
    const original = w.post('/stream', 'stream')
    await sleep(600 - (Date.now() - startedAt))
    const retry = await w.post('/stream', 'stream')
    t.equal(retry.statusCode, 409, 'a retry at 600 ms (2 leases into a 1 s stream) gets 409')
    t.equal(runs, 1)
    const first = await original
    const whole = Array.from({ length: 10 }, (_, i) => `chunk-${i};`).join('')
    t.equal(first.body, whole)
    const replay = await w.post('/stream', 'stream')
    t.equal(replay.headers['idempotent-replayed'], 'true')
    t.equal(replay.body, whole, 'the replay is the whole stream')
    t.equal(runs, 1)
  })

  t.test('case 2: a client that stops reading a large stream keeps the key with the owner; when it leaves, the outcome is recorded', async (t) => {
    const w = await world(t)
    let runs = 0
    w.app.post('/big', async (_request, reply) => {
      runs++
      reply.code(201).type('application/octet-stream')
      const chunk = Buffer.alloc(64 * 1024, 7)
      async function * chunks (): AsyncGenerator<Buffer> {
        for (let i = 0; i < 128; i++) yield chunk // 8 MiB
      }
      return Readable.from(chunks())
    })
    const port = await w.listen()
    const startedAt = Date.now()
    const paused = deferred()
    const client = http.request({ host: '127.0.0.1', port, method: 'POST', path: '/big', agent: false, headers: keyed('slow-reader') }, (res) => {
      res.pause() // reads nothing more: the server's writes back up
      paused.resolve()
    })
    client.on('error', () => {})
    client.end(JSON.stringify({ amount: 100 }))
    await paused.promise
    await sleep(600 - (Date.now() - startedAt))
    const retry = await w.post('/big', 'slow-reader')
    t.equal(retry.statusCode, 409, 'a retry at 600 ms gets 409 while the owner still sends')
    t.equal((await w.record('slow-reader'))?.state, 'in_progress')
    client.destroy()
    t.ok(await eventually(async () => (await w.record('slow-reader'))?.state === 'completed'), 'once the client left, the outcome is recorded')
    const after = await w.post('/big', 'slow-reader')
    t.equal(after.statusCode, 410, 'over maxResponseBytes: not retained, never executed again')
    t.equal(typeOf(after), PROBLEM_TYPE('response-not-retained'))
    t.equal(runs, 1)
  })

  t.test('case 2: renewal goes on across the retries of a failed record write', async (t) => {
    let failures = 2
    const w = await world(t, (store) => ({
      ...store,
      complete: async (lease, response, ttl) => {
        if (failures-- > 0) throw new Error('connection reset')
        return await store.complete(lease, response, ttl)
      }
    // 100 ms, not less: a claim answered after one lease starts nothing (lib/fastify/claim.ts), and a
    // first claim on a busy machine (a new connection, a statement prepared) can take tens of ms.
    }), { lease: 100 })
    let runs = 0
    w.app.post('/pay', async (_request, reply) => reply.code(201).send({ id: `ch_${++runs}` }))
    const original = w.post('/pay', 'record-retry')
    await sleep(180) // almost two leases into the 300 ms of retry delays
    const retry = await w.post('/pay', 'record-retry')
    t.equal(retry.statusCode, 409, 'the key is still the owner\'s while it retries the write')
    t.equal((await original).statusCode, 201)
    const replay = await w.post('/pay', 'record-retry')
    t.equal(replay.headers['idempotent-replayed'], 'true', 'the third write recorded the outcome')
    t.equal(runs, 1)
  })

  t.test('a store unreachable for less than a lease while the answer is recorded: renewal goes on, the record lands, the handler ran once', async (t) => {
    let down = false
    const unreachable = (): Promise<never> => Promise.reject(new Error('connect ECONNREFUSED'))
    const w = await world(t, (store) => ({
      ...store,
      claim: (request) => down ? unreachable() : store.claim(request),
      complete: (lease, response, ttl) => down ? unreachable() : store.complete(lease, response, ttl),
      renew: (lease, ms) => down ? unreachable() : store.renew(lease, ms),
      release: (lease) => down ? unreachable() : store.release(lease)
    }), { lease: 1500 })
    let runs = 0
    w.app.post('/pay', async (_request, reply) => {
      runs++
      // The store goes away as the answer is to be recorded, for longer than the writes the client
      // waits for (about 300 ms) and shorter than a lease.
      down = true
      setTimeout(() => { down = false }, 400)
      return reply.code(201).send({ id: `ch_${runs}` })
    })
    const original = await w.post('/pay', 'outage')
    t.equal(original.statusCode, 201, 'the client gets its answer once the waited writes are spent')
    await sleep(800)
    t.equal((await w.post('/pay', 'outage')).statusCode, 409, 'past the outage, the owner still holds the key: renewal went on')
    t.ok(await eventually(async () => (await w.record('outage'))?.state === 'completed', 4000), 'the record is written once the store is back')
    await sleep(1700) // past a lease: a lapsed lease would now be taken over
    const replay = await w.post('/pay', 'outage')
    t.equal(replay.headers['idempotent-replayed'], 'true', 'the retry replays the recorded answer')
    t.equal(replay.body, original.body)
    t.equal(runs, 1, 'the handler ran once')
  })

  t.test('case 3: a handler slower than the route\'s ttl keeps its in-progress record while it renews', async (t) => {
    const w = await world(t)
    let runs = 0
    w.app.post('/slow', { config: { idempotency: { ttl: 1000 } } }, async (_request, reply) => {
      const run = ++runs
      await sleep(2000)
      return reply.code(201).send({ id: `ch_${run}` })
    })
    const startedAt = Date.now()
    const original = w.post('/slow', 'past-ttl')
    await sleep(1300 - (Date.now() - startedAt))
    const retry = await w.post('/slow', 'past-ttl')
    t.equal(retry.statusCode, 409, 'at 1.3 s, past the 1 s ttl, the running owner still holds the key')
    t.equal(runs, 1)
    t.equal((await original).statusCode, 201)
    const replay = await w.post('/slow', 'past-ttl')
    t.equal(replay.headers['idempotent-replayed'], 'true', 'and the record, kept a ttl from completion, replays')
    t.equal(runs, 1)
  })

  t.test('case 4: a record held for the reconciler outlives its ttl: no retry runs it again, purge keeps it, the reconciler finds it', async (t) => {
    const w = await world(t)
    let charges = 0
    let runs = 0
    w.app.post('/charge', { config: { idempotency: { ttl: 600 } } }, async (request, reply) => {
      runs++
      const context = request.idempotency
      if (context === null) throw new Error('unprotected')
      const charge = await context.step('charge', () => ({ id: `ch_${++charges}` }))
      if (runs === 1) {
        context.markIndeterminate()
        throw new Error('the provider timed out on the receipt')
      }
      return reply.code(201).send(charge)
    })
    t.equal((await w.post('/charge', 'held')).statusCode, 500)
    await sleep(900) // one and a half ttl
    const retry = await w.post('/charge', 'held')
    t.equal(retry.statusCode, 409, 'past its ttl the held record still refuses retries')
    t.equal(runs, 1, 'no retry ran the handler')
    t.equal(charges, 1, 'the recorded charge step did not run again')
    const store = w.store as RecoveryStore
    await store.purgeExpired()
    const inspected = await store.inspect({ scope: SCOPE, key: 'held' })
    t.equal(inspected?.indeterminate, true, 'purgeExpired left it; inspect shows it held')
    t.same(inspected?.steps, { charge: { id: 'ch_1' } })
    t.equal(inspected?.expiresInMs, Infinity, 'a held record does not expire')
    t.same((await store.listHeld()).map((record) => [record.key, record.steps]), [['held', { charge: { id: 'ch_1' } }]], 'listHeld shows it to operators')
    await t.rejects(store.listHeld(0), { code: 'FST_IDEMPOTENCY_INVALID_OPTION' }, 'listHeld(limit) is validated')
    const report = await store.reconcile({
      olderThan: 0,
      resolve: (record) => ({ action: 'complete', response: { statusCode: 201, body: record.steps.charge as object } })
    })
    t.match(report, { examined: 1, completed: 1, lost: 0 }, 'the reconciler found it after its ttl and resolved it')
    t.same(await store.listHeld(), [], 'no longer held')
    const replay = await w.post('/charge', 'held')
    t.equal(replay.statusCode, 201)
    t.same(replay.json(), { id: 'ch_1' })
    t.equal(charges, 1)
  })

  t.test('case 5: an owner that was taken over never runs its next step', async (t) => {
    const tokens: string[] = []
    const partitioned = new Set<string>()
    const w = await world(t, (store) => ({
      ...store,
      claim: async (request) => {
        const result = await store.claim(request)
        if (result.outcome === 'acquired') tokens.push(result.lease.token)
        return result
      },
      // A partitioned owner cannot reach the store: its renewals fail, so its lease really lapses.
      renew: async (lease, ms) => {
        if (partitioned.has(lease.token)) throw new Error('connection timed out')
        return await store.renew(lease, ms)
      }
    }))
    let runs = 0
    let orders = 0
    const firstCharged = deferred()
    const resume = deferred()
    let caught: unknown = null
    w.app.setErrorHandler((error, _request, reply) => { caught = error; return reply.code(500).send({ error: (error as Error).name }) })
    w.app.post('/order', async (request, reply) => {
      const run = ++runs
      const context = request.idempotency
      if (context === null) throw new Error('unprotected')
      const charge = await context.step('charge', () => ({ id: 'ch_1' }))
      if (run === 1) {
        firstCharged.resolve()
        await resume.promise
      }
      const order = await context.step('order', () => ({ id: `ord_${++orders}` }))
      return reply.code(201).send({ charge, order })
    })
    const first = w.post('/order', 'taken-over')
    await firstCharged.promise
    partitioned.add(tokens[0] as string)
    await sleep(LEASE * 2)
    const second = await w.post('/order', 'taken-over')
    t.equal(second.statusCode, 201, 'a retry took the lapsed key over and completed')
    t.same(second.json(), { charge: { id: 'ch_1' }, order: { id: 'ord_1' } }, 'continuing from the recorded charge')
    partitioned.clear() // the first owner reaches the store again, and goes on
    resume.resolve()
    t.equal((await first).statusCode, 500)
    t.ok(caught instanceof LeaseLostError, 'the first owner\'s next step was refused')
    t.equal(orders, 1, 'the order step ran once: only the key\'s owner ran it')
    const replay = await w.post('/order', 'taken-over')
    t.same(replay.json(), second.json(), 'the record is the new owner\'s')
  })

  t.test('case 5: a fence whose answer comes back after its lease proves nothing: the step does not run', async (t) => {
    let slow = false
    const w = await world(t, (store) => ({
      ...store,
      // The store applies the renewal at once, but its answer arrives late (a congested connection).
      renew: async (lease, ms) => {
        const owned = await store.renew(lease, ms)
        if (slow) await sleep(LEASE * 2)
        return owned
      }
    }))
    const ranIn: number[] = []
    let runs = 0
    w.app.post('/late-fence', async (request, reply) => {
      const run = ++runs
      const context = request.idempotency
      if (context === null) throw new Error('unprotected')
      await context.step('a', () => 'done')
      slow = true
      await context.step('b', () => { ranIn.push(run); return 'done' })
      return reply.code(201).send({ ok: true })
    })
    const first = await w.post('/late-fence', 'late-fence')
    slow = false
    t.equal(first.statusCode, 500, 'the unproven step failed the request')
    t.same(ranIn, [], 'step b did not run on a fence answered after its lease')
    await sleep(LEASE * 3) // the late answers of the renewal timer land
    t.same(ranIn, [], 'nor later')
  })

  t.test('case 11: a step result holding U+0000 and an unpaired surrogate is recorded and comes back as it was', async (t) => {
    const w = await world(t)
    const value = { text: 'a\u0000b', lone: '\ud800', nested: ['\u0000', { k: '\udfff' }] }
    let runs = 0
    let ran = 0
    w.app.post('/odd', async (request, reply) => {
      runs++
      const context = request.idempotency
      if (context === null) throw new Error('unprotected')
      const result = await context.step('odd', () => { ran++; return value })
      if (runs === 1) {
        context.markIndeterminate()
        throw new Error('after the step')
      }
      return reply.code(201).send({ same: JSON.stringify(result) === JSON.stringify(value) })
    })
    t.equal((await w.post('/odd', 'odd')).statusCode, 500, 'the step was recorded, then the handler failed')
    const store = w.store as RecoveryStore
    t.same((await store.inspect({ scope: SCOPE, key: 'odd' }))?.steps, { odd: value }, 'the store holds the exact value')
    await store.reconcile({ olderThan: 0, resolve: () => ({ action: 'resume' }) })
    const retry = await w.post('/odd', 'odd')
    t.equal(retry.statusCode, 201)
    t.same(retry.json(), { same: true }, 'the retry got the recorded value back')
    t.equal(ran, 1, 'without running the step again')
  })
}
