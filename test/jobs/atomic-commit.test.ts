import t from 'tap'
import {
  idempotencyRunner, KeyReusedError, memoryStore, RolledBackError, StoreUnavailableError, TransactionEndedError, type IdempotencyStore, type StoredResponse
} from '../../lib/index.js'

/*
 * What a job's run answers when atomic mode's commit does not commit, and when a record holds no
 * value: a store of the test's own decides, so each answer is reached on purpose (the PostgreSQL
 * driver reaches them only through crashes; test/jobs/runner.test.ts runs the rest on it).
 */

/** A memory store that claims "in a transaction" and answers `complete` as `commit` says. */
function transactional (commit: () => Promise<boolean>): IdempotencyStore {
  const inner = memoryStore({ purgeInterval: 0 })
  const store = {
    ...inner,
    claim: inner.claim.bind(inner),
    release: inner.release.bind(inner),
    renew: inner.renew.bind(inner),
    get: inner.get.bind(inner),
    hold: inner.hold?.bind(inner),
    purgeExpired: inner.purgeExpired.bind(inner),
    close: inner.close.bind(inner),
    async claimInTransaction (request: Parameters<NonNullable<IdempotencyStore['claimInTransaction']>>[0]) {
      const result = await inner.claim(request)
      return result.outcome === 'acquired' ? { ...result, transaction: { query: () => 'the transaction' } } : result
    },
    complete: async () => await commit()
  }
  return store
}

t.test('atomic mode: a commit that rolled back, that the operation ended, or whose outcome is unknown', async (t) => {
  const cases: Array<[string, () => Promise<boolean>, (err: unknown) => boolean, string]> = [
    ['the transaction had already ended before the commit', async () => false, (err) => err instanceof RolledBackError, 'RolledBackError: nothing committed'],
    ['the driver saw a rollback', async () => { throw new RolledBackError('rolled back') }, (err) => err instanceof RolledBackError, 'the driver\'s RolledBackError'],
    ['the operation ended the transaction', async () => { throw new TransactionEndedError(true) }, (err) => err instanceof TransactionEndedError, 'the driver\'s TransactionEndedError'],
    ['the connection dropped after COMMIT', async () => { throw new Error('Connection terminated') }, (err) => err instanceof StoreUnavailableError && err.outcomeUnknown && (err.cause as Error).message === 'Connection terminated', 'StoreUnavailableError, outcomeUnknown, with the cause']
  ]
  for (const [what, commit, expected, says] of cases) {
    const store = transactional(commit)
    const runner = idempotencyRunner({ store, transaction: true, storeTimeout: 500 })
    let sql: unknown
    const err = await runner.run({ key: `k-${what}`, operation: 'op' }, async (op) => { sql = op.sql; return { ok: true } }).then(() => null, (e: unknown) => e)
    t.ok(expected(err), `${what}: ${says} (${String(err)})`)
    t.equal(typeof (sql as { query?: unknown } | undefined)?.query, 'function', `${what}: fn got the claim's transaction as op.sql`)
    t.equal(err instanceof StoreUnavailableError ? (err as StoreUnavailableError).code : 'n/a', err instanceof StoreUnavailableError ? 'FST_IDEMPOTENCY_STORE_UNAVAILABLE' : 'n/a')
    await runner.close()
    await store.close()
  }
})

t.test('a completed record without its value (only a route records one) is refused, never run again', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  const runner = idempotencyRunner({ store: inner })
  t.teardown(() => runner.close())
  // Record a run, then swap its body for none, as a route's oversized answer is recorded.
  await runner.run({ key: 'k', operation: 'op' }, async () => 'value')
  const store: IdempotencyStore = {
    ...inner,
    claim: async (request) => {
      const result = await inner.claim(request)
      return result.outcome === 'completed' ? { ...result, response: { ...result.response, body: null } as StoredResponse } : result
    }
  }
  const swapped = idempotencyRunner({ store })
  t.teardown(() => swapped.close())
  let ran = false
  const err = await swapped.run({ key: 'k', operation: 'op' }, async () => { ran = true }).then(() => null, (e: unknown) => e)
  t.ok(err instanceof KeyReusedError, `refused (${String(err)})`)
  t.notOk(ran, 'fn did not run a second time')
})
