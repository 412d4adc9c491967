import { createHash } from 'node:crypto'
import t from 'tap'
import { memoryStore } from '../../lib/index.js'
import type { ClaimRequest, Fingerprint, Lease } from '../../lib/core/store.js'
import { manualClock } from '../helpers/app.js'

/**
 * The memory store's fencing: a lease that no longer owns its record (taken over by a retry, or the
 * record expired) loads no steps and records none, and a step name already recorded is not recorded
 * again. A record in progress that expired is claimed afresh, without its steps.
 */

const fp: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('body').digest() }
const request = (key: string): ClaimRequest => ({ scope: 's', key, fingerprint: fp, leaseMs: 100, ttlMs: 1000 })

function acquired (result: ReturnType<ReturnType<typeof memoryStore>['claim']>): Lease {
  if (result.outcome !== 'acquired') throw new Error(`not acquired: ${result.outcome}`)
  return result.lease
}

t.test('a lease taken over by a retry loads no steps and records none; a name is recorded once', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0 })
  t.teardown(() => store.close())
  const first = acquired(store.claim(request('k')))
  t.equal(await store.saveStep(first, 'charge', '{"id":"ch_1"}'), true)
  t.equal(await store.saveStep(first, 'charge', '{"id":"ch_2"}'), false, 'the name is recorded already')
  t.same(await store.loadSteps(first), { charge: { id: 'ch_1' } }, 'the first result kept')

  clock.advance(100)
  const retry = acquired(store.claim(request('k')))
  t.not(retry.token, first.token)
  t.equal(await store.loadSteps(first), null, 'the old lease loads nothing')
  t.equal(await store.saveStep(first, 'email', '{}'), false, 'and records nothing')
  t.same(await store.loadSteps(retry), { charge: { id: 'ch_1' } }, 'the retry continues from the steps')
})

t.test('a record in progress that expired is claimed afresh, without its steps', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0 })
  t.teardown(() => store.close())
  const first = acquired(store.claim(request('k')))
  await store.saveStep(first, 'charge', '{"id":"ch_1"}')
  clock.advance(1000)
  const claim = store.claim(request('k'))
  t.match(claim, { outcome: 'acquired', takeover: false }, 'a fresh record, not a takeover')
  t.same(await store.loadSteps(acquired(claim)), {}, 'no steps')
  t.equal(await store.loadSteps(first), null)
  t.equal(store.usage().records, 1, 'the expired record was counted off')
})
