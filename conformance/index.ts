import { createHash, randomUUID } from 'node:crypto'
import type { Test } from 'tap'
import type { Fingerprint, IdempotencyStore, StoredResponse } from '../../lib/store.js'

/**
 * The driver conformance suite: every driver's test file runs it against its own store. Times are
 * real and short (a driver may measure them on a database clock that a test cannot move).
 *
 * `makeStore` returns a store on a clean namespace; the suite closes it when it ends.
 */
export function runConformance (t: Test, makeStore: () => Promise<IdempotencyStore>): void {
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
  const fresh = (): string => `key-${randomUUID()}`

  let store: IdempotencyStore
  t.before(async () => { store = await makeStore() })
  t.teardown(async () => { await store.close() })

  t.test('a fresh key is acquired, then reported in progress with its fingerprint', async (t) => {
    const key = fresh()
    const first = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    t.equal(first.outcome, 'acquired')
    if (first.outcome !== 'acquired') return
    t.equal(first.takeover, false)
    t.equal(first.lease.scope, 's')
    t.equal(first.lease.key, key)
    t.type(first.lease.token, 'string')
    t.ok(first.lease.token.length >= 16, 'the token is not guessable')

    const second = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    t.equal(second.outcome, 'in_progress')
    if (second.outcome !== 'in_progress') return
    t.equal(second.fingerprint.algorithm, 'canonical-v1')
    t.ok(second.fingerprint.digest.equals(A.digest))
    t.ok(second.leaseRemainingMs > 0 && second.leaseRemainingMs <= LONG)

    const third = await store.claim({ scope: 's', key, fingerprint: B, leaseMs: LONG, ttlMs: LONG })
    t.equal(third.outcome, 'in_progress', 'a different fingerprint changes nothing')
    if (third.outcome === 'in_progress') t.ok(third.fingerprint.digest.equals(A.digest), 'the original fingerprint is reported')
  })

  t.test('complete records the response byte for byte; claims then report it', async (t) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    t.equal(await store.complete(claim.lease, response, LONG), true)
    const again = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    t.equal(again.outcome, 'completed')
    if (again.outcome !== 'completed') return
    t.equal(again.response.statusCode, 201)
    t.same(again.response.headers, response.headers)
    t.ok(again.response.body?.equals(response.body as Buffer))
    t.ok(again.fingerprint.digest.equals(A.digest))
    if (again.expiresInMs !== undefined) {
      t.ok(again.expiresInMs > 0 && again.expiresInMs <= LONG, `expiresInMs (${again.expiresInMs}) never exceeds the remaining retention`)
    }
    const record = await store.get({ scope: 's', key })
    t.equal(record?.state, 'completed')
    if (record?.state === 'completed') t.ok(record.response.body?.equals(response.body as Buffer))
    t.equal(await store.complete(claim.lease, { ...response, statusCode: 500 }, LONG), false, 'a completed record cannot be completed again')
    t.equal(await store.release(claim.lease), false, 'nor released')
  })

  t.test('empty, binary and not-retained bodies round-trip', async (t) => {
    const bodies: Array<Buffer | null> = [Buffer.alloc(0), Buffer.from([0, 255, 1, 254, 0x22, 0x5c]), null]
    for (const body of bodies) {
      const key = fresh()
      const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
      if (claim.outcome !== 'acquired') return t.fail('not acquired')
      t.ok(await store.complete(claim.lease, { statusCode: 204, headers: {}, body }, LONG))
      const record = await store.get({ scope: 's', key })
      if (record?.state !== 'completed') return t.fail('not completed')
      if (body === null) t.equal(record.response.body, null)
      else t.ok(record.response.body?.equals(body), `body of ${body.length} bytes`)
      t.same(record.response.headers, {})
    }
  })

  t.test('complete, release and renew are fenced by the token', async (t) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    const forged = { ...claim.lease, token: randomUUID() }
    t.equal(await store.complete(forged, response, LONG), false)
    t.equal(await store.release(forged), false)
    t.equal(await store.renew(forged, LONG), false)
    t.equal((await store.get({ scope: 's', key }))?.state, 'in_progress', 'nothing changed')
    t.equal(await store.renew(claim.lease, LONG), true)
    t.equal(await store.release(claim.lease), true)
    t.equal(await store.get({ scope: 's', key }), null)
    const retry = await store.claim({ scope: 's', key, fingerprint: B, leaseMs: LONG, ttlMs: LONG })
    t.equal(retry.outcome, 'acquired', 'a released key executes again, with any request')
  })

  t.test('an expired lease is taken over by the same request only, and the old owner is fenced out', async (t) => {
    const key = fresh()
    const first = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 40, ttlMs: LONG })
    if (first.outcome !== 'acquired') return t.fail('not acquired')
    t.equal((await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 40, ttlMs: LONG })).outcome, 'in_progress', 'not before the lease expires')
    await sleep(80)
    const other = await store.claim({ scope: 's', key, fingerprint: B, leaseMs: LONG, ttlMs: LONG })
    t.equal(other.outcome, 'in_progress', 'a different request never takes over')
    const takeover = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    t.equal(takeover.outcome, 'acquired')
    if (takeover.outcome !== 'acquired') return
    t.equal(takeover.takeover, true)
    t.not(takeover.lease.token, first.lease.token)
    t.equal(await store.renew(first.lease, LONG), false, 'the zombie cannot renew')
    t.equal(await store.complete(first.lease, { ...response, statusCode: 299 }, LONG), false, 'the zombie cannot complete')
    t.equal(await store.release(first.lease), false, 'the zombie cannot release')
    t.equal(await store.complete(takeover.lease, response, LONG), true)
    const record = await store.get({ scope: 's', key })
    t.equal(record?.state === 'completed' ? record.response.statusCode : null, 201, "the new owner's record stands")
  })

  t.test('renew keeps a running owner from being taken over', async (t) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 60, ttlMs: LONG })
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    for (let i = 0; i < 4; i++) {
      await sleep(30)
      t.equal(await store.renew(claim.lease, 60), true)
    }
    t.equal((await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 60, ttlMs: LONG })).outcome, 'in_progress')
  })

  t.test('a fingerprint of another algorithm is a different request', async (t) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 30, ttlMs: LONG })
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    await sleep(60)
    const other = await store.claim({ scope: 's', key, fingerprint: { algorithm: 'raw-v1', digest: A.digest }, leaseMs: LONG, ttlMs: LONG })
    t.equal(other.outcome, 'in_progress')
    if (other.outcome === 'in_progress') t.equal(other.fingerprint.algorithm, 'canonical-v1')
  })

  t.test('records expire after their ttl: reads forget them and the key executes as new', async (t) => {
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 50, ttlMs: 60 })
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    t.ok(await store.complete(claim.lease, response, 60))
    t.equal((await store.get({ scope: 's', key }))?.state, 'completed')
    await sleep(120)
    t.equal(await store.get({ scope: 's', key }), null)
    const again = await store.claim({ scope: 's', key, fingerprint: B, leaseMs: LONG, ttlMs: LONG })
    t.equal(again.outcome, 'acquired')
    if (again.outcome === 'acquired') t.equal(again.takeover, false)
  })

  t.test('purgeExpired deletes expired records in bounded batches and keeps live ones', async (t) => {
    const scope = `purge-${randomUUID()}`
    for (let i = 0; i < 5; i++) {
      const claim = await store.claim({ scope, key: `old-${i}`, fingerprint: A, leaseMs: 20, ttlMs: 30 })
      if (claim.outcome === 'acquired' && i % 2 === 0) await store.complete(claim.lease, response, 30)
    }
    const live = await store.claim({ scope, key: 'live', fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    await sleep(80)
    let purged = await store.purgeExpired(2)
    t.ok(purged <= 2, 'a batch is bounded by its limit')
    for (let round = 0; round < 100 && purged < 5; round++) {
      const batch = await store.purgeExpired(2)
      if (batch === 0) break
      purged += batch
    }
    t.ok(purged >= 5, `the expired records went (${purged})`)
    t.equal((await store.get({ scope, key: 'live' }))?.state, 'in_progress', 'the live one stayed')
    if (live.outcome === 'acquired') await store.release(live.lease)
  })

  t.test('scopes are independent, and (scope, key) pairs cannot alias each other', async (t) => {
    const key = fresh()
    const pairs: Array<[string, string]> = [['a', `b${key}`], ['ab', key], ['a:b', key], [`a${key}`, ''], ['', `a${key}`]]
    const tokens = new Set<string>()
    for (const [scope, k] of pairs) {
      if (k === '') continue
      const claim = await store.claim({ scope, key: k, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
      t.equal(claim.outcome, 'acquired', `scope ${JSON.stringify(scope)} key ${JSON.stringify(k.slice(0, 6))}`)
      if (claim.outcome === 'acquired') tokens.add(claim.lease.token)
    }
    t.equal(tokens.size, 4)
  })

  t.test('keys and scopes with quotes, backslashes, unicode and metacharacters are stored exactly', async (t) => {
    const nasty = ["'; DROP TABLE x; --", 'a"b\\c', 'ünïcødé ✓ 🙂', '{{tag}}:*?[]', 'redis.call("FLUSHALL")', '%s%n$1\\x00']
    for (const value of nasty) {
      const claim = await store.claim({ scope: value, key: value, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
      if (claim.outcome !== 'acquired') return t.fail(`not acquired: ${value}`)
      t.equal(claim.lease.key, value)
      t.ok(await store.complete(claim.lease, { ...response, body: Buffer.from(value) }, LONG))
      const record = await store.get({ scope: value, key: value })
      t.equal(record?.state === 'completed' ? record.response.body?.toString() : null, value)
      t.equal(await store.get({ scope: 'other', key: value }), null, 'not visible from another scope')
    }
  })

  t.test('simultaneous claims of one key: exactly one is acquired', async (t) => {
    const key = fresh()
    const results = await Promise.all(Array.from({ length: 50 }, () =>
      store.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })))
    t.equal(results.filter((r) => r.outcome === 'acquired').length, 1)
    t.equal(results.filter((r) => r.outcome === 'in_progress').length, 49)
  })

  t.test('get never changes anything and reports unknown keys as null', async (t) => {
    t.equal(await store.get({ scope: 's', key: fresh() }), null)
    const key = fresh()
    const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 30, ttlMs: LONG })
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    await sleep(60)
    const record = await store.get({ scope: 's', key })
    t.equal(record?.state, 'in_progress', 'an expired lease is still in progress to readers')
    if (record?.state === 'in_progress') t.equal(record.leaseRemainingMs, 0)
    t.equal(await store.complete(claim.lease, response, LONG), true, 'get did not take the record over')
  })
}
