import { randomBytes } from 'node:crypto'
import diagnostics from 'node:diagnostics_channel'
import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, {
  DECISION_CHANNEL, InvalidOptionError, KeyReusedError, memoryStore, OperationInProgressError, type DecisionEvent, type IdempotencyOptions, type MemoryStore
} from '../../lib/index.js'
import { deferred } from '../helpers/app.js'

/*
 * `fastify.idempotency.run()`: the job door on an app's own registration. It shares the routes'
 * store, defaults, encryption, metrics and in-process waiters, and is refused once the app closed.
 */

async function appWith (t: Test, options: IdempotencyOptions = {}): Promise<{ app: FastifyInstance, store: MemoryStore }> {
  const store = memoryStore({ purgeInterval: 0 })
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: () => 'acct', ...options })
  await app.ready()
  return { app, store }
}

t.test('a run records its value in the registration\'s store, and a second run replays it', async (t) => {
  const { app, store } = await appWith(t)
  let runs = 0
  const first = await app.idempotency.run({ key: 'job-1', operation: 'invoice', payload: { order: 7 }, scope: 'acct' }, async (op) => {
    runs++
    t.equal(op.key, 'job-1')
    t.equal(op.scope, 'acct')
    return { invoice: 7, at: new Date(0) }
  })
  t.same(first, { value: { invoice: 7, at: '1970-01-01T00:00:00.000Z' }, replayed: false }, 'the value as JSON carries it, on the first run too')
  const again = await app.idempotency.run({ key: 'job-1', operation: 'invoice', payload: { order: 7 }, scope: 'acct' }, async () => { runs++ })
  t.same(again, { value: { invoice: 7, at: '1970-01-01T00:00:00.000Z' }, replayed: true })
  t.equal(runs, 1, 'fn ran once')
  const record = await store.get({ scope: 'acct', key: 'job-1' })
  t.equal(record?.state, 'completed', 'the record is in the app\'s store')
  t.equal(record?.state === 'completed' ? record.response.body?.toString() : null, '{"invoice":7,"at":"1970-01-01T00:00:00.000Z"}')

  await t.rejects(app.idempotency.run({ key: 'job-1', operation: 'invoice', payload: { order: 8 }, scope: 'acct' }, async () => { runs++ }), KeyReusedError, 'another payload: FST_IDEMPOTENCY_MISMATCH')
  await t.rejects(app.idempotency.run({ key: 'job-1', operation: 'refund', payload: { order: 7 }, scope: 'acct' }, async () => { runs++ }), KeyReusedError, 'another operation')
  const other = await app.idempotency.run({ key: 'job-1', operation: 'invoice', payload: { order: 8 }, scope: 'acct_b' }, async () => { runs++; return 'b' })
  t.same(other, { value: 'b', replayed: false }, 'another scope is another key space')
  t.equal(runs, 2)
})

t.test('the registration\'s defaults: wait lets a duplicate get the original\'s value; without it, OperationInProgressError', async (t) => {
  const { app } = await appWith(t, { wait: 2_000 })
  const gate = deferred()
  let runs = 0
  const original = app.idempotency.run({ key: 'k', operation: 'op' }, async () => { runs++; await gate.promise; return 1 })
  const duplicate = app.idempotency.run({ key: 'k', operation: 'op' }, async () => { runs++; return 2 })
  const refused = app.idempotency.run({ key: 'k', operation: 'op', wait: 0 }, async () => { runs++; return 3 })
  const err = await refused.then(() => null, (e: unknown) => e)
  t.ok(err instanceof OperationInProgressError, 'a run that does not wait is refused')
  t.equal((err as OperationInProgressError).code, 'FST_IDEMPOTENCY_IN_PROGRESS')
  t.equal((err as OperationInProgressError).retryAfter, 1000, 'retryAfter in ms: the registration\'s retryAfter (1 s)')
  gate.resolve()
  t.same(await original, { value: 1, replayed: false })
  t.same(await duplicate, { value: 1, replayed: true }, 'the waiting duplicate is woken by the original\'s record')
  t.equal(runs, 1)
})

t.test('a throw releases the key and propagates unchanged; markIndeterminate holds it', async (t) => {
  const { app, store } = await appWith(t)
  const declined = new Error('declined')
  await t.rejects(app.idempotency.run({ key: 'k1', operation: 'op' }, async () => { throw declined }), declined)
  t.equal(await store.get({ scope: '', key: 'k1' }), null, 'released')
  t.same(await app.idempotency.run({ key: 'k1', operation: 'op' }, async () => 'second'), { value: 'second', replayed: false }, 'the retry runs')

  await t.rejects(app.idempotency.run({ key: 'k2', operation: 'op' }, async (op) => { op.markIndeterminate(); throw new Error('timeout') }), /timeout/)
  t.equal((await store.get({ scope: '', key: 'k2' }))?.state, 'in_progress', 'held for the reconciler')
  await t.rejects(app.idempotency.run({ key: 'k2', operation: 'op' }, async () => 'never'), OperationInProgressError, 'a retry is refused while it is held')
})

t.test('a value JSON cannot carry is not recorded, and the key is held (fn returned: its effect may have happened)', async (t) => {
  const { app, store } = await appWith(t)
  await t.rejects(app.idempotency.run({ key: 'k', operation: 'op' }, async () => ({ big: 1n })), TypeError)
  t.equal((await store.get({ scope: '', key: 'k' }))?.state, 'in_progress', 'held, never released for a rerun')
})

t.test('the registration\'s encryption seals a run\'s value, and its decisions reach the diagnostics channel', async (t) => {
  const { app, store } = await appWith(t, { encryption: { keys: [{ id: 'k1', key: randomBytes(32) }] } })
  const events: DecisionEvent[] = []
  const listener = (message: unknown): void => { events.push(message as DecisionEvent) }
  diagnostics.subscribe(DECISION_CHANNEL, listener)
  t.teardown(() => { diagnostics.unsubscribe(DECISION_CHANNEL, listener) })
  await app.idempotency.run({ key: 'secret-job', operation: 'payout', payload: { iban: 'DE00' } }, async () => ({ payout: 'po_secret_value' }))
  const record = await store.get({ scope: '', key: 'secret-job' })
  t.equal(record?.state, 'completed')
  t.notOk(record?.state === 'completed' && record.response.body?.toString('latin1').includes('po_secret_value'), 'the stored value is sealed')
  t.same(await app.idempotency.run({ key: 'secret-job', operation: 'payout', payload: { iban: 'DE00' } }, async () => null), { value: { payout: 'po_secret_value' }, replayed: true }, 'and opened on replay')
  const mine = events.filter((event) => event.key === 'secret-job')
  t.same(mine.map((event) => [event.outcome, event.method, event.route, event.request]), [
    ['executed', 'RUN', 'payout', undefined],
    ['recorded', 'RUN', 'payout', undefined],
    ['replayed', 'RUN', 'payout', undefined]
  ], 'RUN, the operation as the route, no request')
})

t.test('options are validated when run() is called, naming the option; a closed app refuses runs', async (t) => {
  const { app } = await appWith(t)
  const cases: Array<[unknown, RegExp]> = [
    [{ key: '', operation: 'op' }, /run\(\) option "key" must be a non-empty string/],
    [{ key: 'k' }, /run\(\) option "operation"/],
    [{ key: 'k', operation: 'op', payload: () => 1 }, /run\(\) option "payload" must be JSON-serializable/],
    [{ key: 'k', operation: 'op', lease: 0 }, /run\(\) option "lease"/],
    [{ key: 'k', operation: 'op', transaction: true }, /run\(\) option "transaction" must be false unless the store supports transactions/],
    [{ key: 'k', operation: 'op', idempotencyKey: 'x' }, /run\(\) option "idempotencyKey" must be one of key, operation/],
    [{ key: 'k\u0000', operation: 'op' }, /without control characters/]
  ]
  let ran = false
  for (const [options, message] of cases) {
    const err = await app.idempotency.run(options as never, async () => { ran = true }).then(() => null, (e: unknown) => e)
    t.ok(err instanceof InvalidOptionError, `refused: ${String(err)}`)
    t.match(String((err as Error).message), message)
  }
  t.notOk(ran, 'fn never ran for a refused option')
  await app.close()
  await t.rejects(app.idempotency.run({ key: 'k', operation: 'op' }, async () => { ran = true }), /was closed/)
  t.notOk(ran)
})
