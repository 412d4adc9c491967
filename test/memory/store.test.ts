import { createHash } from 'node:crypto'
import t from 'tap'
import { memoryStore, MemoryStoreFullError, type MemoryStore } from '../../lib/index.js'
import type { Fingerprint, IdempotencyStore } from '../../lib/core/store.js'
import { manualClock } from '../helpers/app.js'
import { runConformance } from '../../conformance/index.js'
import { sleep } from '../helpers/sleep.js'

const fp: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('x').digest() }

t.test('conformance', async (t) => {
  runConformance({ test: (name, fn) => t.test(name, fn), makeStore: () => memoryStore({ purgeInterval: 0 }) })
})

/** The memory store behind a wrapper whose operations answer promises, as a store doing I/O does. */
function promised (store: MemoryStore): IdempotencyStore {
  return {
    ...store,
    claim: async (request) => store.claim(request),
    complete: async (lease, response, ttlMs) => store.complete(lease, response, ttlMs),
    release: async (lease) => store.release(lease),
    renew: async (lease, leaseMs) => store.renew(lease, leaseMs),
    hold: async (lease) => store.hold(lease)
  }
}

t.test('conformance of the same store answering promises: the suite takes results directly or as promises', async (t) => {
  runConformance({ test: (name, fn) => t.test(name, fn), makeStore: () => promised(memoryStore({ purgeInterval: 0 })) })
})

t.test('claim, complete, release, renew and hold answer directly, not with promises', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const claim = store.claim({ scope: 's', key: 'k', fingerprint: fp, leaseMs: 100, ttlMs: 1000 })
  t.equal(claim.outcome, 'acquired')
  if (claim.outcome !== 'acquired') return
  t.equal(store.renew(claim.lease, 100), true)
  t.equal(store.hold(claim.lease), true)
  t.equal(store.complete(claim.lease, { statusCode: 200, headers: {}, body: Buffer.from('ok') }, 1000), true)
  t.equal(store.release(claim.lease), false)
  t.equal(store.claim({ scope: 's', key: 'k', fingerprint: fp, leaseMs: 100, ttlMs: 1000 }).outcome, 'completed')
  t.notOk('sync' in store, 'no second way in beside the methods')

  const small = memoryStore({ purgeInterval: 0, maxEntries: 1 })
  t.teardown(() => small.close())
  small.claim({ scope: 's', key: 'k', fingerprint: fp, leaseMs: 100, ttlMs: 1000 })
  t.throws(() => small.claim({ scope: 's', key: 'other', fingerprint: fp, leaseMs: 100, ttlMs: 1000 }), MemoryStoreFullError, 'a failure throws (the plugin takes a throw as a rejection)')
})

t.test('expiry is honoured on every read and claim, to the millisecond', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0 })
  t.teardown(() => store.close())
  const claim = await store.claim({ scope: 's', key: 'k', fingerprint: fp, leaseMs: 100, ttlMs: 1000 })
  if (claim.outcome !== 'acquired') return t.fail('not acquired')
  await store.complete(claim.lease, { statusCode: 200, headers: {}, body: Buffer.from('ok') }, 1000)
  clock.advance(999)
  t.equal((await store.get({ scope: 's', key: 'k' }))?.state, 'completed')
  t.equal((await store.claim({ scope: 's', key: 'k', fingerprint: fp, leaseMs: 100, ttlMs: 1000 })).outcome, 'completed')
  clock.advance(1)
  t.equal(await store.get({ scope: 's', key: 'k' }), null)
  t.equal((await store.claim({ scope: 's', key: 'k', fingerprint: fp, leaseMs: 100, ttlMs: 1000 })).outcome, 'acquired')
})

t.test('a full store refuses new claims with a clear error and never drops live records', async (t) => {
  const clock = manualClock()
  // One scope alone may fill the whole store (test/memory/fairness.test.ts tests the shares).
  const store = memoryStore({ now: clock.now, purgeInterval: 0, maxEntries: 3 })
  t.teardown(() => store.close())
  for (let i = 0; i < 3; i++) await store.claim({ scope: 's', key: `k${i}`, fingerprint: fp, leaseMs: 100, ttlMs: 1000 })
  t.throws(() => store.claim({ scope: 's', key: 'k3', fingerprint: fp, leaseMs: 100, ttlMs: 1000 }), MemoryStoreFullError)
  for (let i = 0; i < 3; i++) t.equal((await store.get({ scope: 's', key: `k${i}` }))?.state, 'in_progress', `k${i} kept`)
  t.equal((await store.claim({ scope: 's', key: 'k0', fingerprint: fp, leaseMs: 100, ttlMs: 1000 })).outcome, 'in_progress', 'existing keys still answer')
  clock.advance(2000)
  t.equal((await store.claim({ scope: 's', key: 'k3', fingerprint: fp, leaseMs: 100, ttlMs: 1000 })).outcome, 'acquired', 'room is made from expired records')
})

t.test('the byte bound counts recorded bodies, and a response that does not fit is recorded without its body', async (t) => {
  const store = memoryStore({ purgeInterval: 0, maxBytes: 4096 })
  t.teardown(() => store.close())
  const claim = store.claim({ scope: 's', key: 'big', fingerprint: fp, leaseMs: 100, ttlMs: 60_000 })
  if (claim.outcome !== 'acquired') return t.fail('not acquired')
  const claimed = store.usage().bytes
  t.ok(store.complete(claim.lease, { statusCode: 200, headers: { 'content-type': 'text/plain' }, body: Buffer.alloc(5000) }, 60_000), 'a completion is never refused: the effect happened')
  t.ok(store.usage().bytes <= claimed, `recording the outcome alone needed no more than the claim counted (${store.usage().bytes} of ${claimed})`)
  const record = await store.get({ scope: 's', key: 'big' })
  t.same(record?.state === 'completed' ? record.response : null, { statusCode: 200, headers: {}, body: null }, 'the outcome is recorded without its body and headers: a retry gets 410, never a re-execution')
  const fits = store.claim({ scope: 's', key: 'fits', fingerprint: fp, leaseMs: 100, ttlMs: 60_000 })
  if (fits.outcome !== 'acquired') return t.fail('not acquired')
  t.ok(store.complete(fits.lease, { statusCode: 201, headers: {}, body: Buffer.alloc(1000, 1) }, 60_000))
  const kept = await store.get({ scope: 's', key: 'fits' })
  t.equal(kept?.state === 'completed' ? kept.response.body?.length : null, 1000, 'a body that fits is kept whole')
  let claims = 0
  for (; claims < 100; claims++) {
    try { store.claim({ scope: 's', key: `next-${claims}`, fingerprint: fp, leaseMs: 100, ttlMs: 60_000 }) } catch (err) {
      t.type(err, MemoryStoreFullError)
      break
    }
  }
  t.ok(claims < 100, `claims are refused once their records would not fit (${claims} more fitted)`)
  t.ok(store.usage().bytes <= 4096, `the bound holds (${store.usage().bytes} bytes)`)
})

t.test('the purge timer sweeps expired records and close clears it', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 10 })
  for (let i = 0; i < 25; i++) await store.claim({ scope: 's', key: `k${i}`, fingerprint: fp, leaseMs: 10, ttlMs: 50 })
  clock.advance(100)
  await sleep(50)
  t.equal(await store.purgeExpired(), 0, 'the timer already purged everything')
  await store.close()
  t.equal(await store.purgeExpired(), 0)
})

t.test('options are validated', async (t) => {
  t.throws(() => memoryStore({ maxEntries: 0 }), { code: 'FST_IDEMPOTENCY_INVALID_OPTION', message: /memoryStore option "maxEntries" must be an integer from 1 .*; received 0/ })
  t.throws(() => memoryStore({ maxBytes: 1.5 }), /memoryStore option "maxBytes" .*received 1\.5/)
  t.throws(() => memoryStore({ purgeInterval: -1 }), /memoryStore option "purgeInterval" .*received -1/)
  t.throws(() => memoryStore({ now: 5 as unknown as () => number }), /memoryStore option "now" must be a function.*received 5/)
})

t.test('bodies are copied out of the caller\'s (possibly pooled) buffers', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const claim = await store.claim({ scope: 's', key: 'pool', fingerprint: fp, leaseMs: 100, ttlMs: 60_000 })
  if (claim.outcome !== 'acquired') return t.fail('not acquired')
  const pooled = Buffer.from('small body')
  t.ok(pooled.buffer.byteLength > pooled.length, 'precondition: a pooled slice')
  await store.complete(claim.lease, { statusCode: 200, headers: {}, body: pooled }, 60_000)
  const record = await store.get({ scope: 's', key: 'pool' })
  const body = record?.state === 'completed' ? record.response.body : null
  t.equal(body?.toString(), 'small body')
  t.not(body?.buffer, pooled.buffer, 'the store does not keep a view of the pool slab')
  pooled.write('CHANGED!!!')
  const again = await store.get({ scope: 's', key: 'pool' })
  t.equal(again?.state === 'completed' ? again.response.body?.toString() : null, 'small body', 'later writes to the original do not reach the record')
})
