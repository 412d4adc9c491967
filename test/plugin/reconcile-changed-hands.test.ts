import { createHash } from 'node:crypto'
import t, { type Test } from 'tap'
import { memoryStore, type MemoryStore } from '../../lib/index.js'
import type { Fingerprint, Lease } from '../../lib/core/store.js'
import { manualClock } from '../helpers/app.js'

/**
 * A reconcile pass on records that change hands while it runs: an operator force-releases the
 * record `resolve` is deciding, a retry or another pass settles the next candidate before the pass
 * gets to it, more records are stuck than one pass examines. The pass reports what it applied and
 * what it lost, and never acts on a record it does not hold.
 */

const fp: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('order').digest() }
const LEASE = 100
const TTL = 60_000

function stuckStore (t: Test): { store: MemoryStore, clock: ReturnType<typeof manualClock>, crash: (key: string) => Lease } {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0 })
  t.teardown(() => store.close())
  /** A record whose owner went away: its lease lapses and nobody settles it. */
  const crash = (key: string): Lease => {
    const claim = store.claim({ scope: 'acct', key, fingerprint: fp, leaseMs: LEASE, ttlMs: TTL })
    if (claim.outcome !== 'acquired') throw new Error(`${key} was not acquired`)
    return claim.lease
  }
  return { store, clock, crash }
}

t.test('a record force-released while resolve decides it: resume and leave are lost, not applied', async (t) => {
  const { store, clock, crash } = stuckStore(t)
  crash('resumed')
  crash('left')
  clock.advance(LEASE)
  const report = await store.reconcile({
    olderThan: 0,
    resolve: async (record) => {
      t.equal(await store.forceRelease({ scope: record.scope, key: record.key }), true, `${record.key} released under the pass`)
      return { action: record.key === 'resumed' ? 'resume' : 'leave' }
    }
  })
  t.match(report, { examined: 2, resumed: 0, left: 0, lost: 2, errors: [] })
  t.equal(await store.get({ scope: 'acct', key: 'resumed' }), null, 'resume did not bring the record back')
  t.equal(await store.get({ scope: 'acct', key: 'left' }), null, 'leave did not bring the record back')
})

t.test('a candidate settled by a retry before the pass reaches it is skipped, not examined', async (t) => {
  const { store, clock, crash } = stuckStore(t)
  crash('first')
  crash('second')
  clock.advance(LEASE)
  const seen: string[] = []
  const report = await store.reconcile({
    olderThan: 0,
    resolve: (record) => {
      seen.push(record.key)
      // A retry of the other key takes it over meanwhile (its lease lapsed): the candidate the pass
      // found is no longer owned by the token it found it with.
      const retry = store.claim({ scope: 'acct', key: record.key === 'first' ? 'second' : 'first', fingerprint: fp, leaseMs: LEASE, ttlMs: TTL })
      t.equal(retry.outcome, 'acquired', 'the retry took the other record over')
      return { action: 'release' }
    }
  })
  t.equal(seen.length, 1, 'resolve ran for one record only')
  t.match(report, { examined: 1, released: 1, lost: 0, errors: [] })
  const other = seen[0] === 'first' ? 'second' : 'first'
  t.match(await store.inspect({ scope: 'acct', key: other }), { state: 'in_progress', leaseRemainingMs: LEASE }, 'the retry still holds it')
})

t.test('a pass examines at most `limit` records; the rest wait for the next pass', async (t) => {
  const { store, clock, crash } = stuckStore(t)
  for (const key of ['a', 'b', 'c']) crash(key)
  clock.advance(LEASE)
  const first = await store.reconcile({ olderThan: 0, limit: 2, resolve: () => ({ action: 'release' }) })
  t.match(first, { examined: 2, released: 2 })
  t.equal(store.usage().records, 1, 'one record is left')
  const second = await store.reconcile({ olderThan: 0, limit: 2, resolve: () => ({ action: 'release' }) })
  t.match(second, { examined: 1, released: 1 })
  t.equal(store.usage().records, 0)
})

t.test('a held record resumed by the reconciler expires again, a ttl from the resumption', async (t) => {
  const { store, clock, crash } = stuckStore(t)
  const lease = crash('held')
  t.equal(store.hold(lease), true)
  t.match(await store.inspect({ scope: 'acct', key: 'held' }), { indeterminate: true, expiresInMs: Infinity }, 'held: it never expires')
  clock.advance(5 * TTL)
  const report = await store.reconcile({ olderThan: 0, ttl: 1000, resolve: () => ({ action: 'resume' }) })
  t.match(report, { examined: 1, resumed: 1 })
  t.match(await store.inspect({ scope: 'acct', key: 'held' }), { state: 'in_progress', indeterminate: false, expiresInMs: 1000 })
  clock.advance(1000)
  t.equal(await store.get({ scope: 'acct', key: 'held' }), null, 'gone at its new expiry')
})

t.test('resume keeps a record\'s later expiry when it had more than a ttl left', async (t) => {
  const { store, clock, crash } = stuckStore(t)
  crash('young')
  clock.advance(LEASE)
  // the reconciler's own lease (10 ms) is shorter than what is left: it does not extend the record
  const report = await store.reconcile({ olderThan: 0, lease: 10, ttl: 1000, resolve: () => ({ action: 'resume' }) })
  t.match(report, { resumed: 1 })
  t.match(await store.inspect({ scope: 'acct', key: 'young' }), { expiresInMs: TTL - LEASE }, 'its own expiry, not the shorter ttl')
})
