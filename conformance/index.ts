import assert from 'node:assert/strict'
import { createHash, randomUUID } from 'node:crypto'
import type { ClaimResult, Fingerprint, IdempotencyStore, StoredResponse } from '../lib/core/store.js'
import { settlementDigest } from '../lib/core/waiters.js'

/**
 * Registers one test. node:test's `test` fits as it is; with tap, pass `(name, fn) => t.test(name, fn)`.
 * A case fails by throwing (its assertions are `node:assert/strict`), which every runner reports.
 */
export type ConformanceTest = (name: string, fn: () => Promise<void>) => unknown

export interface ConformanceOptions {
  readonly test: ConformanceTest
  /** A store on a clean namespace. Each case makes its own and closes it when the case ends. */
  readonly makeStore: () => IdempotencyStore | Promise<IdempotencyStore>
}

/**
 * The driver conformance suite: the contract of `IdempotencyStore` that the plugin relies on, as
 * tests a driver's own test file registers with its runner. It imports no test framework, so a
 * third-party driver runs it with node:test, tap or anything with a `test(name, fn)`. Times are
 * real and short (a driver may measure them on a database clock that a test cannot move).
 *
 * An operation may answer its result directly or a promise of it (lib/core/store.ts, `Answer`): the
 * suite awaits every answer, which takes both, and never calls `.then` on one.
 */
export function runConformance (options: ConformanceOptions): void {
  const { test, makeStore } = options
  const fp = (text: string, algorithm = 'canonical-v1'): Fingerprint => ({ algorithm, digest: createHash('sha256').update(text).digest() })
  const A = fp('request A')
  const B = fp('request B')
  const LONG = 60_000
  const response: StoredResponse = {
    statusCode: 201,
    headers: { 'content-type': 'application/json; charset=utf-8', location: '/payments/1', link: ['<a>; rel="x"', '<b>; rel="y"'] },
    body: Buffer.from('{"id":"pay_1","amount":100}')
  }
  const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms))
  const isThenable = (value: unknown): boolean =>
    value !== null && (typeof value === 'object' || typeof value === 'function') && typeof (value as { then?: unknown }).then === 'function'
  const fresh = (): string => `key-${randomUUID()}`

  /** Each case gets a fresh store, closed whatever the case's outcome. */
  const withStore = (name: string, fn: (store: IdempotencyStore) => Promise<void>): void => {
    test(name, async () => {
      const store = await makeStore()
      try {
        await fn(store)
      } finally {
        await store.close()
      }
    })
  }

  withStore('a fresh key is acquired, then reported in progress with its fingerprint', async (store) => {
    const key = fresh()
    const first = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    assert.equal(first.outcome, 'acquired')
    if (first.outcome !== 'acquired') return
    assert.equal(first.takeover, false)
    assert.equal(first.lease.scope, 's')
    assert.equal(first.lease.key, key)
    assert.equal(typeof first.lease.token, 'string')
    assert.ok(first.lease.token.length >= 16, 'the token is not guessable')

    const second = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    assert.equal(second.outcome, 'in_progress')
    if (second.outcome !== 'in_progress') return
    assert.equal(second.fingerprint.algorithm, 'canonical-v1')
    assert.ok(second.fingerprint.digest.equals(A.digest))
    assert.ok(second.leaseRemainingMs > 0 && second.leaseRemainingMs <= LONG)

    const third = await store.claim({ scope: 's', key, fingerprint: B, leaseMs: LONG, ttlMs: LONG })
    assert.equal(third.outcome, 'in_progress', 'a different fingerprint changes nothing')
    if (third.outcome === 'in_progress') assert.ok(third.fingerprint.digest.equals(A.digest), 'the original fingerprint is reported')
  })

  withStore('complete records the response byte for byte; claims then report it', async (store) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    if (claim.outcome !== 'acquired') assert.fail('not acquired')
    assert.equal(await store.complete(claim.lease, response, LONG), true)
    const again = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    assert.equal(again.outcome, 'completed')
    if (again.outcome !== 'completed') return
    assert.equal(again.response.statusCode, 201)
    assert.deepEqual(again.response.headers, response.headers)
    assert.ok(again.response.body?.equals(response.body as Buffer))
    assert.ok(again.fingerprint.digest.equals(A.digest))
    if (again.expiresInMs !== undefined) {
      assert.ok(again.expiresInMs > 0 && again.expiresInMs <= LONG, `expiresInMs (${again.expiresInMs}) never exceeds the remaining retention`)
    }
    const record = await store.get({ scope: 's', key })
    assert.equal(record?.state, 'completed')
    if (record?.state === 'completed') assert.ok(record.response.body?.equals(response.body as Buffer))
    assert.equal(await store.complete(claim.lease, { ...response, statusCode: 500 }, LONG), false, 'a completed record cannot be completed again')
    assert.equal(await store.release(claim.lease), false, 'nor released')
  })

  withStore('empty, binary and not-retained bodies round-trip', async (store) => {
    const bodies: Array<Buffer | null> = [Buffer.alloc(0), Buffer.from([0, 255, 1, 254, 0x22, 0x5c]), null]
    for (const body of bodies) {
      const key = fresh()
      const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
      if (claim.outcome !== 'acquired') assert.fail('not acquired')
      assert.ok(await store.complete(claim.lease, { statusCode: 204, headers: {}, body }, LONG))
      const record = await store.get({ scope: 's', key })
      if (record?.state !== 'completed') assert.fail('not completed')
      if (body === null) assert.equal(record.response.body, null)
      else assert.ok(record.response.body?.equals(body), `body of ${body.length} bytes`)
      assert.deepEqual(record.response.headers, {})
    }
  })

  withStore('complete, release and renew are fenced by the token', async (store) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    if (claim.outcome !== 'acquired') assert.fail('not acquired')
    const forged = { ...claim.lease, token: randomUUID() }
    assert.equal(await store.complete(forged, response, LONG), false)
    assert.equal(await store.release(forged), false)
    assert.equal(await store.renew(forged, LONG), false)
    assert.equal((await store.get({ scope: 's', key }))?.state, 'in_progress', 'nothing changed')
    assert.equal(await store.renew(claim.lease, LONG), true)
    assert.equal(await store.release(claim.lease), true)
    assert.equal(await store.get({ scope: 's', key }), null)
    const retry = await store.claim({ scope: 's', key, fingerprint: B, leaseMs: LONG, ttlMs: LONG })
    assert.equal(retry.outcome, 'acquired', 'a released key executes again, with any request')
  })

  withStore('an expired lease is taken over by the same request only, and the old owner is fenced out', async (store) => {
    const key = fresh()
    const first = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 40, ttlMs: LONG })
    if (first.outcome !== 'acquired') assert.fail('not acquired')
    assert.equal((await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 40, ttlMs: LONG })).outcome, 'in_progress', 'not before the lease expires')
    await sleep(80)
    const other = await store.claim({ scope: 's', key, fingerprint: B, leaseMs: LONG, ttlMs: LONG })
    assert.equal(other.outcome, 'in_progress', 'a different request never takes over')
    const takeover = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    assert.equal(takeover.outcome, 'acquired')
    if (takeover.outcome !== 'acquired') return
    assert.equal(takeover.takeover, true)
    assert.notEqual(takeover.lease.token, first.lease.token)
    assert.equal(await store.renew(first.lease, LONG), false, 'the zombie cannot renew')
    assert.equal(await store.complete(first.lease, { ...response, statusCode: 299 }, LONG), false, 'the zombie cannot complete')
    assert.equal(await store.release(first.lease), false, 'the zombie cannot release')
    assert.equal(await store.complete(takeover.lease, response, LONG), true)
    const record = await store.get({ scope: 's', key })
    assert.equal(record?.state === 'completed' ? record.response.statusCode : null, 201, "the new owner's record stands")
  })

  // How the plugin gives back a takeover whose answer came too late to be used: the record must stay
  // (a release would drop its steps, and a retry would repeat their effects), and must not wait out
  // the lease it was granted (a retry would get 409 for nothing until then).
  withStore('renew with leaseMs 0 gives the lease up at once: the record stays in progress, with its steps, and the same request takes it over', async (store) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    if (claim.outcome !== 'acquired') assert.fail('not acquired')
    const { saveStep, loadSteps } = store
    const steps = saveStep !== undefined && loadSteps !== undefined
    if (steps) assert.equal(await saveStep.call(store, claim.lease, 'charge', '{"id":"ch_1"}'), true)
    assert.equal(await store.renew(claim.lease, 0), true)
    const record = await store.get({ scope: 's', key })
    assert.equal(record?.state, 'in_progress', 'the record stays')
    if (record?.state === 'in_progress') assert.equal(record.leaseRemainingMs, 0, 'its lease is over')
    const other = await store.claim({ scope: 's', key, fingerprint: B, leaseMs: LONG, ttlMs: LONG })
    assert.equal(other.outcome, 'in_progress', 'another request does not take it over')
    const takeover = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    assert.equal(takeover.outcome, 'acquired', 'the same request takes it over at once, not after the lease it was granted')
    if (takeover.outcome !== 'acquired') return
    assert.equal(takeover.takeover, true)
    if (steps) assert.deepEqual(await loadSteps.call(store, takeover.lease), { charge: { id: 'ch_1' } }, 'with its steps')
    assert.equal(await store.renew(claim.lease, LONG), false, 'the owner that gave it up is fenced out')
    assert.equal(await store.complete(takeover.lease, response, LONG), true)
  })

  withStore('operations answer their result directly or as a promise of it; a result answered directly is already in effect', async (store) => {
    const key = fresh()
    const request = { scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG }
    // Taken as the plugin takes an answer: a thenable is awaited, anything else is the result.
    const answer = store.claim(request)
    const claim = await answer
    assert.ok(typeof claim === 'object' && claim !== null && !isThenable(claim), 'a claim result is a plain object, not a thenable')
    if (claim.outcome !== 'acquired') assert.fail('not acquired')
    const direct = !isThenable(answer)
    if (direct) {
      // Nothing ran in between: what the answer says must already be so.
      const again = store.claim(request)
      assert.ok(!isThenable(again), 'a store that answers a claim directly answers the next one directly too')
      assert.equal((again as ClaimResult).outcome, 'in_progress', 'the record existed when the first claim answered')
    }
    assert.equal(await store.renew(claim.lease, LONG), true)
    const completed = store.complete(claim.lease, response, LONG)
    if (direct && !isThenable(completed)) {
      assert.equal(completed, true)
      assert.equal((store.claim(request) as ClaimResult).outcome, 'completed', 'the response was recorded when complete answered')
    }
    assert.equal(await completed, true, 'complete answers a boolean')
    assert.equal(await store.release(claim.lease), false, 'release answers a boolean, also when the answer is no')
    if (typeof store.hold === 'function') {
      const held = await store.claim({ ...request, key: fresh() })
      if (held.outcome !== 'acquired') assert.fail('not acquired')
      assert.equal(await store.hold(held.lease), true, 'hold answers a boolean')
    }
  })

  withStore('renew keeps a running owner from being taken over', async (store) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 60, ttlMs: LONG })
    if (claim.outcome !== 'acquired') assert.fail('not acquired')
    for (let i = 0; i < 4; i++) {
      await sleep(30)
      assert.equal(await store.renew(claim.lease, 60), true)
    }
    assert.equal((await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 60, ttlMs: LONG })).outcome, 'in_progress')
  })

  withStore('a fingerprint of another algorithm is a different request', async (store) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 30, ttlMs: LONG })
    if (claim.outcome !== 'acquired') assert.fail('not acquired')
    await sleep(60)
    const other = await store.claim({ scope: 's', key, fingerprint: { algorithm: 'raw-v1', digest: A.digest }, leaseMs: LONG, ttlMs: LONG })
    assert.equal(other.outcome, 'in_progress')
    if (other.outcome === 'in_progress') assert.equal(other.fingerprint.algorithm, 'canonical-v1')
  })

  withStore('records expire after their ttl: reads forget them and the key executes as new', async (store) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 50, ttlMs: 60 })
    if (claim.outcome !== 'acquired') assert.fail('not acquired')
    assert.ok(await store.complete(claim.lease, response, 60))
    assert.equal((await store.get({ scope: 's', key }))?.state, 'completed')
    await sleep(120)
    assert.equal(await store.get({ scope: 's', key }), null)
    const again = await store.claim({ scope: 's', key, fingerprint: B, leaseMs: LONG, ttlMs: LONG })
    assert.equal(again.outcome, 'acquired')
    if (again.outcome === 'acquired') assert.equal(again.takeover, false)
  })

  // lib/core/store.ts, the first expiry rule: an owner that renews keeps its record past the ttl, or a
  // retry would reclaim it as a fresh record and run the operation beside the owner.
  withStore('an in-progress record never expires while its lease is live: renew and takeover keep it past its ttl', async (store) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 150, ttlMs: 200 })
    if (claim.outcome !== 'acquired') assert.fail('not acquired')
    for (let i = 0; i < 3; i++) {
      await sleep(100)
      assert.equal(await store.renew(claim.lease, 150), true)
    }
    // 300 ms in, past the 200 ms ttl, with the lease renewed until about 450 ms.
    assert.equal((await store.get({ scope: 's', key }))?.state, 'in_progress', 'the renewing owner\'s record is still there')
    const duplicate = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 150, ttlMs: 200 })
    assert.equal(duplicate.outcome, 'in_progress', 'a retry is refused, not given the record as a fresh one')
    await store.release(claim.lease)

    const other = fresh()
    const crashed = await store.claim({ scope: 's', key: other, fingerprint: A, leaseMs: 30, ttlMs: 200 })
    if (crashed.outcome !== 'acquired') assert.fail('not acquired')
    await sleep(60)
    const takeover = await store.claim({ scope: 's', key: other, fingerprint: A, leaseMs: 400, ttlMs: 100 })
    assert.equal(takeover.outcome, 'acquired')
    if (takeover.outcome !== 'acquired') return
    assert.equal(takeover.takeover, true)
    await sleep(250) // past the first claim's ttl and the takeover's own
    assert.equal((await store.get({ scope: 's', key: other }))?.state, 'in_progress', 'the new owner\'s lease keeps the record')
    assert.equal(await store.complete(takeover.lease, response, LONG), true)
  })

  // `watchSettlements` is optional: a driver without it has nothing to check here (its waiters poll).
  withStore('a watcher is told of the completion and the release of a record claimed with announce', async (store) => {
    if (typeof store.watchSettlements !== 'function') return
    const settled: string[] = []
    let live = false
    const stop = store.watchSettlements({ settled: (digest) => { settled.push(digest) }, live: (flowing) => { live = flowing } })
    try {
      for (let i = 0; i < 500 && !live; i++) await sleep(10)
      assert.equal(live, true, 'the watch reports itself live within 5 s')
      const until = async (digest: string): Promise<boolean> => {
        for (let i = 0; i < 200 && !settled.includes(digest); i++) await sleep(10)
        return settled.includes(digest)
      }
      const completed = fresh()
      const first = await store.claim({ scope: 's', key: completed, fingerprint: A, leaseMs: LONG, ttlMs: LONG, announce: true })
      if (first.outcome !== 'acquired') assert.fail('not acquired')
      assert.equal(await store.complete(first.lease, response, LONG), true)
      assert.ok(await until(settlementDigest('s', completed)), 'the completion was noticed, by the record\'s digest')
      const released = fresh()
      const second = await store.claim({ scope: 's', key: released, fingerprint: A, leaseMs: LONG, ttlMs: LONG, announce: true })
      if (second.outcome !== 'acquired') assert.fail('not acquired')
      assert.equal(await store.release(second.lease), true)
      assert.ok(await until(settlementDigest('s', released)), 'the release was noticed')
    } finally {
      stop()
    }
  })

  // lib/core/store.ts, the second expiry rule. `hold` is optional: a driver without it has nothing to check here.
  withStore('a held record never expires, is never reclaimed or taken over, and is never purged', async (store) => {
    if (typeof store.hold !== 'function') return
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 40, ttlMs: 80 })
    if (claim.outcome !== 'acquired') assert.fail('not acquired')
    assert.equal(await store.hold(claim.lease), true)
    await sleep(200) // more than twice its ttl
    assert.equal((await store.get({ scope: 's', key }))?.state, 'in_progress', 'still there past its ttl')
    const retry = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    assert.equal(retry.outcome, 'in_progress', 'a retry is neither given a fresh record nor a takeover')
    const other = await store.claim({ scope: 's', key, fingerprint: B, leaseMs: LONG, ttlMs: LONG })
    assert.equal(other.outcome, 'in_progress', 'nor is a different request')
    await store.purgeExpired()
    assert.equal((await store.get({ scope: 's', key }))?.state, 'in_progress', 'the purge kept it')
  })

  withStore('purgeExpired deletes expired records in bounded batches and keeps live ones', async (store) => {
    const scope = `purge-${randomUUID()}`
    for (let i = 0; i < 5; i++) {
      const claim = await store.claim({ scope, key: `old-${i}`, fingerprint: A, leaseMs: 20, ttlMs: 30 })
      if (claim.outcome === 'acquired' && i % 2 === 0) await store.complete(claim.lease, response, 30)
    }
    const live = await store.claim({ scope, key: 'live', fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    await sleep(80)
    let purged = await store.purgeExpired(2)
    assert.ok(purged <= 2, 'a batch is bounded by its limit')
    for (let round = 0; round < 100 && purged < 5; round++) {
      const batch = await store.purgeExpired(2)
      if (batch === 0) break
      purged += batch
    }
    assert.ok(purged >= 5, `the expired records went (${purged})`)
    assert.equal((await store.get({ scope, key: 'live' }))?.state, 'in_progress', 'the live one stayed')
    if (live.outcome === 'acquired') await store.release(live.lease)
  })

  withStore('scopes are independent, and (scope, key) pairs cannot alias each other', async (store) => {
    const key = fresh()
    const pairs: Array<[string, string]> = [['a', `b${key}`], ['ab', key], ['a:b', key], [`a${key}`, ''], ['', `a${key}`]]
    const tokens = new Set<string>()
    for (const [scope, k] of pairs) {
      if (k === '') continue
      const claim = await store.claim({ scope, key: k, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
      assert.equal(claim.outcome, 'acquired', `scope ${JSON.stringify(scope)} key ${JSON.stringify(k.slice(0, 6))}`)
      if (claim.outcome === 'acquired') tokens.add(claim.lease.token)
    }
    assert.equal(tokens.size, 4)
  })

  withStore('keys and scopes with quotes, backslashes, unicode and metacharacters are stored exactly', async (store) => {
    const nasty = ["'; DROP TABLE x; --", 'a"b\\c', 'ünïcødé ✓ 🙂', '{{tag}}:*?[]', 'redis.call("FLUSHALL")', '%s%n$1\\x00']
    for (const value of nasty) {
      const claim = await store.claim({ scope: value, key: value, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
      if (claim.outcome !== 'acquired') assert.fail(`not acquired: ${value}`)
      assert.equal(claim.lease.key, value)
      assert.ok(await store.complete(claim.lease, { ...response, body: Buffer.from(value) }, LONG))
      const record = await store.get({ scope: value, key: value })
      assert.equal(record?.state === 'completed' ? record.response.body?.toString() : null, value)
      assert.equal(await store.get({ scope: 'other', key: value }), null, 'not visible from another scope')
    }
  })

  withStore('simultaneous claims of one key: exactly one is acquired', async (store) => {
    const key = fresh()
    const results = await Promise.all(Array.from({ length: 50 }, () =>
      store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })))
    assert.equal(results.filter((r) => r.outcome === 'acquired').length, 1)
    assert.equal(results.filter((r) => r.outcome === 'in_progress').length, 49)
  })

  withStore('get never changes anything and reports unknown keys as null', async (store) => {
    assert.equal(await store.get({ scope: 's', key: fresh() }), null)
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 30, ttlMs: LONG })
    if (claim.outcome !== 'acquired') assert.fail('not acquired')
    await sleep(60)
    const record = await store.get({ scope: 's', key })
    assert.equal(record?.state, 'in_progress', 'an expired lease is still in progress to readers')
    if (record?.state === 'in_progress') assert.equal(record.leaseRemainingMs, 0)
    assert.equal(await store.complete(claim.lease, response, LONG), true, 'get did not take the record over')
  })
}
