import { randomBytes } from 'node:crypto'
import Fastify from 'fastify'
import postgres from 'postgres'
import t from 'tap'
import idempotency, {
  idempotencyRunner, InvalidOptionError, KeyReusedError, memoryStore, OperationInProgressError, StoreUnavailableError, type IdempotencyStore, type MemoryStore
} from '../../lib/index.js'
import { deriveKey } from '../../lib/core/derive.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { CLIENT_NAME, endPools, exec, storeConnection } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'
import { closedPort } from '../helpers/closed-port.js'

/**
 * The job runner on its own, without a queue: `idempotencyRunner({ store }).run(options, fn)` on the
 * memory store and on PostgreSQL (DATABASE_URL) in lease mode and in atomic mode. One key runs `fn`
 * once and replays its value; a run of a key in flight is refused (or waits, then replays); another
 * operation or payload under the key is refused; a failing store refuses before `fn`; a failing
 * `fn` releases the key, or holds it for the reconciler. The checks count `fn`'s calls, and in
 * atomic mode the rows `fn` wrote through `op.sql`. The PostgreSQL store runs on the client under
 * test (test/helpers/postgres-clients.ts).
 */

interface Mode {
  readonly name: string
  readonly store: () => IdempotencyStore & Pick<MemoryStore, 'listHeld' | 'reconcile'>
  /** What every run of the mode adds to its options: `transaction: true` in atomic mode. */
  readonly run: { readonly transaction?: true }
  /** Lease mode (memory or PostgreSQL): recovery points, and a lease a live run renews (atomic mode has neither). */
  readonly steps: boolean
}

interface Deferred<T = void> { promise: Promise<T>, resolve: (value: T) => void }
function deferred<T = void> (): Deferred<T> {
  let resolve!: (value: T) => void
  const promise = new Promise<T>((_resolve) => { resolve = _resolve })
  return { promise, resolve }
}
const newKey = (label: string): string => `${label}-${randomBytes(6).toString('hex')}`
const rejection = async (promise: Promise<unknown>): Promise<unknown> => await promise.then(() => null, (err: unknown) => err)

const memory = memoryStore()
t.teardown(() => memory.close())
const modes: Mode[] = [{ name: 'memory store', store: () => memory, run: {}, steps: true }]

const DATABASE_URL = process.env.DATABASE_URL
/** PostgreSQL: the rows written for `key` (atomic mode's effects). */
let writes: ((key: string) => Promise<number>) | null = null
/** Atomic mode: writes a row for `key` through the run's transaction handle. */
let effectsInsert: ((handle: unknown, key: string) => Promise<void>) | null = null
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/jobs/runner.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  const { name: schema, sql } = postgresSchema(t, DATABASE_URL, {
    prefix: 'idem_runner',
    client: { max: 4 },
    migrate: ['records'],
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.effects (key text NOT NULL)`
  })
  const store = postgresStore({ ...storeConnection(sql), schema, table: 'records', purgeInterval: 0 })
  t.teardown(async () => {
    await store.close()
    await endPools()
  })
  writes = async (key) => Number((await sql`SELECT count(*)::int AS n FROM ${sql(schema)}.effects WHERE key = ${key}`)[0]?.n)
  const effectsTable = `"${schema}".effects`
  effectsInsert = async (handle, key) => { await exec(handle, `INSERT INTO ${effectsTable} (key) VALUES ($1)`, [key]) }
  modes.push(
    { name: `PostgreSQL (${CLIENT_NAME}), lease mode`, store: () => store, run: {}, steps: true },
    { name: `PostgreSQL (${CLIENT_NAME}), atomic mode`, store: () => store, run: { transaction: true }, steps: false }
  )
}

for (const mode of modes) {
  const atomic = mode.run.transaction === true
  t.test(mode.name, async (t) => {
    const runner = idempotencyRunner({ store: mode.store() })
    const options = (key: string, extra: Record<string, unknown> = {}): Parameters<typeof runner.run>[0] =>
      ({ key, operation: 'send-invoice', payload: { orderId: 42, lines: [1, 2] }, ...mode.run, ...extra }) as Parameters<typeof runner.run>[0]

    t.test('runs fn once, records its value and replays it to the next run of the key', async (t) => {
      const key = newKey('once')
      let calls = 0
      const first = await runner.run(options(key), async (op) => {
        calls++
        t.equal(op.key, key, 'op.key')
        t.equal(op.scope, '', 'op.scope: the default scope')
        if (atomic) t.ok(op.sql !== undefined, 'op.sql: the claim\'s transaction')
        else t.equal(op.sql, undefined, 'op.sql: atomic mode only')
        return { invoiceId: 7, lines: [1, 2], note: 'sent' }
      })
      t.same(first.value, { invoiceId: 7, lines: [1, 2], note: 'sent' })
      t.equal(first.replayed, false)
      const again = await runner.run(options(key), async () => { calls++; return { invoiceId: 8 } })
      t.same(again.value, first.value, 'the recorded value')
      t.equal(again.replayed, true)
      t.equal(calls, 1, 'fn ran once')

      const other = await runner.run(options(key, { scope: 'tenant-2' }), async (op) => {
        calls++
        t.equal(op.scope, 'tenant-2')
        return { invoiceId: 9 }
      })
      t.same(other, { value: { invoiceId: 9 }, replayed: false }, 'another scope is another key space')
      t.equal(calls, 2)
    })

    t.test('any JSON value is recorded and replayed as it was', async (t) => {
      for (const value of ['text', 0, 12.5, true, false, [1, 'two', { three: 3 }], { nested: { deep: [null, 'x'] } }]) {
        const key = newKey('json')
        const first = await runner.run(options(key), async () => value)
        const again = await runner.run(options(key), async () => 'not this')
        t.same(first.value, value, `${JSON.stringify(value)}: the first run's value`)
        t.same(again, { value, replayed: true }, `${JSON.stringify(value)}: replayed`)
      }
    })

    t.test('a value JSON cannot carry: run rejects with a TypeError, and the key is held since fn ran (released in atomic mode)', async (t) => {
      const key = newKey('bigint')
      let calls = 0
      const refused = await rejection(runner.run(options(key), async () => { calls++; return { amount: 1n } }))
      t.match(refused, { name: 'TypeError', message: /JSON-serializable/ })
      const next = await rejection(runner.run(options(key), async () => { calls++; return 1 }))
      if (atomic) t.equal(next, null, 'atomic mode: rolled back, so the next run ran')
      else t.match(next, { code: 'FST_IDEMPOTENCY_IN_PROGRESS' }, 'held for the reconciler: its effect may have happened')
      t.equal(calls, atomic ? 2 : 1)
    })

    t.test('a payload is fingerprinted as JSON: the same members in another order are the same payload', async (t) => {
      const key = newKey('order')
      let calls = 0
      await runner.run(options(key, { payload: { a: 1, b: { c: 2, d: 3 } } }), async () => { calls++; return 1 })
      const again = await runner.run(options(key, { payload: { b: { d: 3, c: 2 }, a: 1 } }), async () => { calls++; return 2 })
      t.same(again, { value: 1, replayed: true })
      t.equal(calls, 1)
    })

    t.test('two runs of one key at once: fn runs once, the other is refused with OperationInProgressError', async (t) => {
      const key = newKey('concurrent')
      const entered = deferred()
      const gate = deferred()
      let calls = 0
      const first = runner.run(options(key), async () => { calls++; entered.resolve(); await gate.promise; return { n: 1 } })
      await entered.promise
      const started = Date.now()
      const refused = await rejection(runner.run(options(key), async () => { calls++; return { n: 2 } }))
      t.ok(refused instanceof OperationInProgressError, `OperationInProgressError (${String(refused)})`)
      t.match(refused, { code: 'FST_IDEMPOTENCY_IN_PROGRESS' })
      const retryAfter = (refused as OperationInProgressError).retryAfter
      t.ok(typeof retryAfter === 'number' && retryAfter >= 0 && retryAfter <= 30_000, `retryAfter in ms: ${retryAfter}`)
      t.ok(Date.now() - started < 2_000, 'refused at once: wait is 0 by default')
      gate.resolve()
      t.same(await first, { value: { n: 1 }, replayed: false })
      t.equal(calls, 1, 'one effect')
    })

    t.test('with wait, the duplicate waits for the original and resolves its value, replayed', async (t) => {
      const key = newKey('wait')
      const entered = deferred()
      const gate = deferred()
      let calls = 0
      const first = runner.run(options(key), async () => { calls++; entered.resolve(); await gate.promise; return { n: 1 } })
      await entered.promise
      const duplicate = runner.run(options(key, { wait: 5_000 }), async () => { calls++; return { n: 2 } })
      await sleep(300)
      gate.resolve()
      const [a, b] = await Promise.all([first, duplicate])
      t.same(a, { value: { n: 1 }, replayed: false })
      t.same(b, { value: { n: 1 }, replayed: true }, 'the duplicate got the original\'s value')
      t.equal(calls, 1)
    })

    t.test('wait is a bound: a duplicate of a run that outlasts it is refused once it elapsed', async (t) => {
      const key = newKey('bound')
      const entered = deferred()
      const gate = deferred()
      const first = runner.run(options(key), async () => { entered.resolve(); await gate.promise; return 1 })
      await entered.promise
      const started = Date.now()
      const refused = await rejection(runner.run(options(key, { wait: 400 }), async () => 2))
      const waited = Date.now() - started
      gate.resolve()
      await first
      t.match(refused, { code: 'FST_IDEMPOTENCY_IN_PROGRESS' })
      t.ok(waited >= 350 && waited < 3_000, `refused after the wait (${waited} ms)`)
    })

    t.test('the same key with another payload or operation: KeyReusedError, and fn is not called', async (t) => {
      const key = newKey('mismatch')
      let calls = 0
      await runner.run(options(key), async () => { calls++; return { invoiceId: 1 } })
      const payload = await rejection(runner.run(options(key, { payload: { orderId: 43, lines: [1, 2] } }), async () => { calls++; return 2 }))
      t.ok(payload instanceof KeyReusedError, `another payload: KeyReusedError (${String(payload)})`)
      t.match(payload, { code: 'FST_IDEMPOTENCY_MISMATCH' })
      const operation = await rejection(runner.run(options(key, { operation: 'refund' }), async () => { calls++; return 3 }))
      t.ok(operation instanceof KeyReusedError, 'another operation: KeyReusedError')
      const none = await rejection(runner.run(options(key, { payload: undefined }), async () => { calls++; return 4 }))
      t.ok(none instanceof KeyReusedError, 'no payload where there was one: KeyReusedError')
      t.equal(calls, 1)
      t.same(await runner.run(options(key), async () => 5), { value: { invoiceId: 1 }, replayed: true }, 'the record is untouched')
    })

    t.test('fn throwing: its error propagates unchanged and the key is released, so the next run runs', async (t) => {
      const key = newKey('throws')
      const boom = new Error('the provider said no')
      let calls = 0
      const failed = await rejection(runner.run(options(key), async (op) => {
        calls++
        if (atomic && effectsInsert !== null) await effectsInsert(op.sql, key)
        throw boom
      }))
      t.equal(failed, boom, 'the same error object')
      if (atomic && writes !== null) t.equal(await writes(key), 0, 'atomic mode: fn\'s write rolled back with the claim')
      const next = await runner.run(options(key), async (op) => {
        calls++
        if (atomic && effectsInsert !== null) await effectsInsert(op.sql, key)
        return { ok: true }
      })
      t.same(next, { value: { ok: true }, replayed: false }, 'the next run ran fn')
      t.equal(calls, 2)
      if (atomic && writes !== null) t.equal(await writes(key), 1, 'atomic mode: its write committed with the record')
    })

    if (!atomic) {
      t.test('op.markIndeterminate() before failing holds the key: refused until the reconciler resolves it', async (t) => {
        const store = mode.store()
        const key = newKey('held')
        const boom = new Error('timed out talking to the provider')
        let calls = 0
        const failed = await rejection(runner.run(options(key), async (op) => { calls++; op.markIndeterminate(); throw boom }))
        t.equal(failed, boom)
        const refused = await rejection(runner.run(options(key), async () => { calls++; return 1 }))
        t.ok(refused instanceof OperationInProgressError, `held: OperationInProgressError (${String(refused)})`)
        t.ok((await store.listHeld(1000)).some((record) => record.key === key), 'listed as held for the reconciler')
        const report = await store.reconcile({ olderThan: 0, resolve: (record) => record.key === key ? { action: 'release' } : undefined })
        t.equal(report.released, 1, 'the reconciler released it')
        t.same(await runner.run(options(key), async () => { calls++; return 2 }), { value: 2, replayed: false }, 'then the next run runs')
        t.equal(calls, 2)
      })
    } else {
      // Atomic mode has nothing to hold: the claim and fn's writes roll back together, so the key is
      // free whatever fn declared (an outside call fn made is what deriveKey covers).
      t.test('atomic mode: op.markIndeterminate() before failing still rolls the claim back with fn\'s writes; the next run runs', async (t) => {
        const key = newKey('atomic-held')
        const boom = new Error('timed out talking to the provider')
        let calls = 0
        const failed = await rejection(runner.run(options(key), async (op) => {
          calls++
          if (effectsInsert !== null) await effectsInsert(op.sql, key)
          op.markIndeterminate()
          throw boom
        }))
        t.equal(failed, boom)
        if (writes !== null) t.equal(await writes(key), 0, 'fn\'s write rolled back')
        t.notOk((await mode.store().listHeld(1000)).some((record) => record.key === key), 'nothing is held')
        t.same(await runner.run(options(key), async () => { calls++; return 2 }), { value: 2, replayed: false }, 'the next run runs')
        t.equal(calls, 2)
      })
    }

    if (mode.steps) {
      t.test('a step completed before fn threw: the key is held, and a resumed run continues from the step without repeating it', async (t) => {
        const store = mode.store()
        const key = newKey('steps')
        const boom = new Error('the email provider is down')
        let charges = 0
        const failed = await rejection(runner.run(options(key), async (op) => {
          t.equal(op.deriveKey('charge'), deriveKey('', key, 'charge'), 'the derived key of (scope, key, name)')
          const charge = await op.step('charge', async () => { charges++; return { id: 'ch_1', at: new Date(0) } })
          t.same(charge, { id: 'ch_1', at: new Date(0).toJSON() }, 'a step returns its result as recorded: JSON')
          throw boom
        }))
        t.equal(failed, boom)
        t.match(await rejection(runner.run(options(key), async () => 0)), { code: 'FST_IDEMPOTENCY_IN_PROGRESS' }, 'held by default once a step completed')
        const report = await store.reconcile({ olderThan: 0, resolve: (record) => record.key === key ? { action: 'resume' } : undefined })
        t.equal(report.resumed, 1)
        const done = await runner.run(options(key), async (op) => {
          const charge = await op.step('charge', async () => { charges++; return { id: 'ch_2', at: null } })
          return { charge: charge.id }
        })
        t.same(done, { value: { charge: 'ch_1' }, replayed: false }, 'the resumed run got the recorded charge')
        t.equal(charges, 1, 'the charge step ran once')
      })

      t.test('a live run keeps its key however long fn takes: its lease is renewed while fn runs', async (t) => {
        const short = idempotencyRunner({ store: mode.store(), lease: 300 })
        const key = newKey('renewed')
        const entered = deferred()
        const gate = deferred()
        let calls = 0
        const first = short.run(options(key), async () => { calls++; entered.resolve(); await gate.promise; return 1 })
        await entered.promise
        await sleep(1_000) // more than three leases
        t.match(await rejection(short.run(options(key), async () => { calls++; return 2 })), { code: 'FST_IDEMPOTENCY_IN_PROGRESS' }, 'still its own after three leases')
        gate.resolve()
        t.same(await first, { value: 1, replayed: false })
        t.equal(calls, 1)
      })
    }

    if (atomic) {
      t.test('atomic mode: fn\'s writes through op.sql are invisible until they commit with the record', async (t) => {
        const key = newKey('atomic')
        const entered = deferred()
        const gate = deferred()
        const run = runner.run(options(key), async (op) => {
          if (effectsInsert !== null) await effectsInsert(op.sql, key)
          entered.resolve()
          await gate.promise
          return { written: true }
        })
        await entered.promise
        if (writes !== null) t.equal(await writes(key), 0, 'uncommitted while fn runs')
        gate.resolve()
        t.same(await run, { value: { written: true }, replayed: false })
        if (writes !== null) t.equal(await writes(key), 1, 'committed with the record')
      })

      t.test('atomic mode: op.step() is refused, the transaction being the unit of recovery; the key is released', async (t) => {
        const key = newKey('atomic-step')
        let ran = false
        const refused = await rejection(runner.run(options(key), async (op) => await op.step('charge', () => { ran = true; return 1 })))
        t.match(refused, { name: 'TypeError', message: /lease mode/ })
        t.equal(ran, false, 'the step did not run')
        t.same(await runner.run(options(key), async () => 2), { value: 2, replayed: false }, 'the next run runs')
      })
    }
  })
}

t.test('a store whose claim fails or does not answer: StoreUnavailableError, and fn is not called', async (t) => {
  const store = memoryStore()
  t.teardown(() => store.close())
  const failing = (claim: () => unknown): IdempotencyStore => new Proxy(store, {
    get (target, property) {
      if (property === 'claim') return claim
      const value = Reflect.get(target, property, target) as unknown
      return typeof value === 'function' ? value.bind(target) : value
    }
  })
  let calls = 0
  const down = new Error('connection refused')
  const rejected = await rejection(idempotencyRunner({ store: failing(async () => { throw down }) }).run({ key: 'k', operation: 'op' }, async () => { calls++; return 1 }))
  t.ok(rejected instanceof StoreUnavailableError, `a claim that rejects: StoreUnavailableError (${String(rejected)})`)
  t.match(rejected, { code: 'FST_IDEMPOTENCY_STORE_UNAVAILABLE' })
  const thrown = await rejection(idempotencyRunner({ store: failing(() => { throw down }) }).run({ key: 'k', operation: 'op' }, async () => { calls++; return 1 }))
  t.ok(thrown instanceof StoreUnavailableError, 'a claim that throws: StoreUnavailableError')
  const started = Date.now()
  const silent = await rejection(idempotencyRunner({ store: failing(() => new Promise(() => {})), storeTimeout: 300 }).run({ key: 'k', operation: 'op' }, async () => { calls++; return 1 }))
  const waited = Date.now() - started
  t.ok(silent instanceof StoreUnavailableError, 'a claim that never answers: StoreUnavailableError')
  t.ok(waited >= 250 && waited < 3_000, `after storeTimeout (${waited} ms)`)
  t.equal(calls, 0, 'fn never ran')
})

t.test('an unreachable PostgreSQL: StoreUnavailableError in lease and atomic mode, and fn is not called', async (t) => {
  const port = await closedPort()
  const sql = postgres({ host: '127.0.0.1', port, database: 'none', username: 'none', connect_timeout: 2, max: 1, onnotice: () => {} })
  const store: PostgresStore = postgresStore({ sql, purgeInterval: 0 })
  t.teardown(async () => {
    await store.close()
    await sql.end({ timeout: 1 })
  })
  const runner = idempotencyRunner({ store, storeTimeout: 3_000 })
  let calls = 0
  for (const transaction of [false, true]) {
    const refused = await rejection(runner.run({ key: 'k', operation: 'op', ...(transaction ? { transaction: true } : {}) }, async () => { calls++; return 1 }))
    t.ok(refused instanceof StoreUnavailableError, `${transaction ? 'atomic' : 'lease'} mode: StoreUnavailableError (${String(refused)})`)
  }
  t.equal(calls, 0)
})

t.test('fastify.idempotency.run: the plugin\'s store and defaults, and the same records as a runner on that store', async (t) => {
  const store = memoryStore()
  const app = Fastify()
  t.teardown(async () => {
    await app.close()
    await store.close()
  })
  await app.register(idempotency, { store, scope: () => 'account' })
  await app.ready()
  const key = newKey('app')
  let calls = 0
  const run = { key, operation: 'daily-digest', payload: { day: '2026-01-01' }, scope: 'ops' }
  const first = await app.idempotency.run(run, async (op) => { calls++; t.equal(op.scope, 'ops'); return { sent: 3 } })
  t.same(first, { value: { sent: 3 }, replayed: false })
  t.same(await app.idempotency.run(run, async () => { calls++; return { sent: 0 } }), { value: { sent: 3 }, replayed: true })
  t.same(await idempotencyRunner({ store }).run(run, async () => { calls++; return { sent: 0 } }), { value: { sent: 3 }, replayed: true },
    'a runner on the same store sees the app\'s record')
  t.equal(calls, 1)
})

t.test('a run refuses what is not a key, an operation, a known option or a function, before anything is claimed', async (t) => {
  const store = memoryStore()
  t.teardown(() => store.close())
  const runner = idempotencyRunner({ store })
  let calls = 0
  const refusals: Array<[string, unknown]> = [
    ['an empty key', { key: '', operation: 'op' }],
    ['an empty operation', { key: 'k', operation: '' }],
    ['no key', { operation: 'op' }],
    ['no operation', { key: 'k' }],
    ['an unknown option', { key: 'k', operation: 'op', priority: 1 }],
    ['a payload JSON cannot carry', { key: 'k', operation: 'op', payload: { n: 1n } }]
  ]
  for (const [what, options] of refusals) {
    const refused = await rejection(runner.run(options as never, async () => { calls++; return 1 }))
    t.ok(refused instanceof InvalidOptionError, `${what}: InvalidOptionError (${String(refused)})`)
  }
  t.ok(await rejection(runner.run({ key: 'k', operation: 'op' }, null as never)) instanceof InvalidOptionError, 'fn must be a function')
  t.equal(calls, 0)
  t.equal(store.usage().records, 0, 'nothing was claimed')
})
