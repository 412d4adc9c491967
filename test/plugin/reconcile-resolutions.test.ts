import { createHash } from 'node:crypto'
import t, { type Test } from 'tap'
import { memoryStore, type MemoryStore } from '../../lib/index.js'
import type { Fingerprint } from '../../lib/core/store.js'
import { manualClock } from '../helpers/app.js'

/**
 * What a reconcile pass does with each resolution `resolve` returns: a response given as bytes is
 * recorded as it is; a response or an action it cannot apply is an error of that record, which is
 * left for a later pass; the reconciler worker hands each record's error to `onError` with the
 * record it belongs to.
 */

const fp: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('order').digest() }

function withStuck (t: Test, keys: string[]): MemoryStore {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0 })
  t.teardown(() => store.close())
  for (const key of keys) store.claim({ scope: 'acct', key, fingerprint: fp, leaseMs: 100, ttlMs: 60_000 })
  clock.advance(100)
  return store
}

t.test('options that are not an object are refused by name', async (t) => {
  const store = withStuck(t, [])
  for (const options of [null, 'resolve'] as unknown[]) {
    await t.rejects(store.reconcile(options as never), { name: 'InvalidOptionError', message: /memoryStore\.reconcile options must be an object with at least \{ resolve \}/ })
  }
})

t.test('a response given as a Buffer is recorded byte for byte, with no content-type added', async (t) => {
  const store = withStuck(t, ['bytes'])
  const body = Buffer.from([0, 1, 2, 254, 255])
  const report = await store.reconcile({ olderThan: 0, resolve: () => ({ action: 'complete', response: { statusCode: 201, headers: { 'X-Resolved': 'yes' }, body } }) })
  t.match(report, { examined: 1, completed: 1, errors: [] })
  const record = await store.inspect({ scope: 'acct', key: 'bytes' })
  t.equal(record?.state, 'completed')
  t.same(record?.response?.body, body)
  t.same(record?.response?.headers, { 'x-resolved': 'yes' }, 'names lower-cased; no content-type for bytes')
})

t.test('an unknown action or a response status out of range: an error of that record, which is left for later', async (t) => {
  const store = withStuck(t, ['unknown', 'status'])
  const report = await store.reconcile({
    olderThan: 0,
    resolve: (record) => record.key === 'unknown'
      ? { action: 'finish' } as never
      : { action: 'complete', response: { statusCode: 199 } }
  })
  t.match(report, { examined: 2, completed: 0, left: 0, lost: 0 })
  const byKey = Object.fromEntries(report.errors.map((e) => [e.key, e.error]))
  t.match(byKey.unknown, { name: 'TypeError', message: 'fastify-idempotency: resolve() returned an unknown action "finish"' })
  t.match(byKey.status, { name: 'TypeError', message: /response\.statusCode must be an integer from 200 to 599; received 199/ })
  for (const key of ['unknown', 'status']) {
    t.match(await store.inspect({ scope: 'acct', key }), { state: 'in_progress', leaseRemainingMs: 0 }, `${key}: given back as it was`)
  }
  const again = await store.reconcile({ olderThan: 0, resolve: () => ({ action: 'release' }) })
  t.match(again, { examined: 2, released: 2 }, 'a later pass finds both again')
})

t.test('the reconciler worker hands each record\'s error to onError with the record it belongs to', async (t) => {
  const store = withStuck(t, ['failing'])
  const failures: Array<{ error: unknown, record: unknown }> = []
  await new Promise<void>((resolve, reject) => {
    // The worker's timer does not keep the process alive (it is unref'd): this one does, and bounds the wait.
    const bound = setTimeout(() => reject(new Error('no pass reported within 5 s')), 5000)
    const worker = store.startReconciler({
      interval: 1,
      olderThan: 0,
      resolve: () => { throw new Error('provider unreachable') },
      onError: (error, record) => { failures.push({ error, record }) },
      onReport: () => { clearTimeout(bound); void worker.stop().then(resolve) }
    })
  })
  t.equal(failures.length, 1)
  t.match(failures[0], { error: { message: 'provider unreachable' }, record: { scope: 'acct', key: 'failing' } })
  t.match(await store.inspect({ scope: 'acct', key: 'failing' }), { state: 'in_progress' }, 'the record is left')
})
