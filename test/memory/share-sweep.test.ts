import { createHash } from 'node:crypto'
import t from 'tap'
import { memoryStore, MemoryStoreFullError } from '../../lib/index.js'
import type { ClaimRequest, Fingerprint } from '../../lib/core/store.js'
import { manualClock } from '../helpers/app.js'

/**
 * The memory store's per-scope shares when a scope reaches its own: it first sweeps its own expired
 * records (completed and in progress) and goes on if that made room; a scope that holds nothing, and
 * whose first claim is larger than its whole share, is refused as a scope (`scoped: true`) while
 * the room left is kept for the other scopes' shares. A read of a record in progress past its
 * expiry finds nothing.
 */

const fp: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('body').digest() }
const request = (scope: string, key: string, ttlMs = 60_000): ClaimRequest => ({ scope, key, fingerprint: fp, leaseMs: Math.min(ttlMs, 1000), ttlMs })

t.test('a scope at its share sweeps its own expired records, completed and in progress, then claims', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0, maxEntries: 4, maxEntriesPerScope: 2 })
  t.teardown(() => store.close())
  const done = store.claim(request('a', 'k1', 10))
  if (done.outcome !== 'acquired') return t.fail('k1 not acquired')
  t.equal(store.complete(done.lease, { statusCode: 200, headers: {}, body: Buffer.from('ok') }, 10), true, 'k1: completed, expiring with k2')
  t.equal(store.claim(request('a', 'k2', 10)).outcome, 'acquired')
  t.equal(store.claim(request('b', 'b1')).outcome, 'acquired')
  clock.advance(10)
  t.equal(store.usage().records, 3, 'the expired records are still counted: nothing swept them yet')
  // Scope a holds its share (2) and the one free record is kept for b's share: a is refused unless it makes room.
  const claim = store.claim(request('a', 'k3'))
  t.equal(claim.outcome, 'acquired', 'a\'s own expired records made the room')
  t.same(store.usage(), { records: 2, bytes: store.usage().bytes, scopes: 2 }, 'k1 and k2 are gone; k3 and b1 remain')
  t.equal(await store.get({ scope: 'a', key: 'k1' }), null)
  t.equal((await store.get({ scope: 'b', key: 'b1' }))?.state, 'in_progress', 'the other scope\'s record is untouched')
})

t.test('a scope holding nothing whose first claim exceeds its byte share is refused as a scope', async (t) => {
  // What a claim is counted for, measured on a store of its own: a short key, and a long one.
  const probe = memoryStore({ purgeInterval: 0 })
  t.teardown(() => probe.close())
  probe.claim(request('b', 'b'))
  const small = probe.usage().bytes
  const longKey = 'k'.repeat(300)
  probe.claim(request('a', longKey))
  const large = probe.usage().bytes - small
  t.ok(large > small + 200, 'the long key\'s claim counts more')

  // b's share leaves it 100 bytes it may still claim within; a's claim is over a's whole share,
  // and the store has room for it but not for it and b's 100 bytes.
  const share = small + 100
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0, maxBytesPerScope: share, maxBytes: small + large + 99 })
  t.teardown(() => store.close())
  t.equal(store.claim(request('b', 'b')).outcome, 'acquired')
  const error = t.throws(() => store.claim(request('a', longKey))) as MemoryStoreFullError
  t.ok(error instanceof MemoryStoreFullError)
  t.equal(error.scoped, true, 'refused as a scope, not as a full store')
  t.match(error.message, `maxBytesPerScope: ${share} bytes`)
  t.same(store.usage(), { records: 1, bytes: small, scopes: 1 }, 'nothing of a\'s was counted')
  t.equal(store.claim(request('b', 'b2')).outcome, 'acquired', 'b still claims within its share')
})

t.test('a record in progress past its expiry: get finds nothing, and it is no longer counted', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0 })
  t.teardown(() => store.close())
  store.claim(request('s', 'k', 100))
  clock.advance(99)
  t.equal((await store.get({ scope: 's', key: 'k' }))?.state, 'in_progress')
  clock.advance(1)
  t.equal(await store.get({ scope: 's', key: 'k' }), null)
  t.same(store.usage(), { records: 0, bytes: 0, scopes: 0 })
})
