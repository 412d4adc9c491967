import { createHash } from 'node:crypto'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, MemoryStoreFullError, type MemoryStoreOptions } from '../lib/index.js'
import type { ClaimResult, Fingerprint, IdempotencyStore } from '../lib/store.js'
import { manualClock } from './helpers/app.js'

/**
 * Issue 16, finding 1: the memory store's bounds were global, so one tenant that filled it had every
 * tenant answered 503 until its records expired (768 requests of about 1 MiB to an echo route filled
 * the default store in 14 s). Each scope now holds at most its share (`maxEntriesPerScope`,
 * `maxBytesPerScope`, a quarter of the store's by default): a scope at its share is refused, and
 * only that scope; no live record of any scope is dropped to make room.
 */

const fp: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('x').digest() }
const MiB = 1024 * 1024

function claim (store: IdempotencyStore, scope: string, key: string, ttlMs = 60_000): Promise<ClaimResult> {
  return store.claim({ scope, key, fingerprint: fp, leaseMs: 30_000, ttlMs })
}

/** The MemoryStoreFullError a claim is refused with (a test failure if it is not refused so). */
async function refusal (t: Test, claimed: Promise<ClaimResult>): Promise<MemoryStoreFullError | null> {
  const err = await claimed.then(() => null, (e: unknown) => e)
  t.type(err, MemoryStoreFullError, 'refused with MemoryStoreFullError')
  return err instanceof MemoryStoreFullError ? err : null
}

async function completed (t: Test, store: IdempotencyStore, scope: string, key: string, body: Buffer, ttlMs = 60_000): Promise<void> {
  const claimed = await claim(store, scope, key, ttlMs)
  if (claimed.outcome !== 'acquired') throw new Error(`${scope}/${key}: ${claimed.outcome}`)
  t.ok(await store.complete(claimed.lease, { statusCode: 201, headers: { 'content-type': 'application/octet-stream' }, body }, ttlMs))
}

/** An echo route answering `size` bytes, scoped by the `x-tenant` header, on the store given. */
async function echoApp (t: Test, options: MemoryStoreOptions): Promise<{ app: FastifyInstance, runs: Map<string, number> }> {
  const store = memoryStore({ purgeInterval: 0, ...options })
  const app = Fastify()
  t.teardown(async () => { await app.close(); await store.close() })
  await app.register(idempotency, { store, scope: (request) => String(request.headers['x-tenant']) })
  const runs = new Map<string, number>()
  app.post('/echo', async (request, reply) => {
    const tenant = String(request.headers['x-tenant'])
    runs.set(tenant, (runs.get(tenant) ?? 0) + 1)
    return reply.code(201).type('application/octet-stream').send(Buffer.alloc(Number((request.query as { size: string }).size), 'e'))
  })
  return { app, runs }
}

const echo = (app: FastifyInstance, tenant: string, key: string, size: number): Promise<LightMyRequestResponse> =>
  app.inject({ method: 'POST', url: `/echo?size=${size}`, headers: { 'x-tenant': tenant, 'idempotency-key': `"${key}"`, 'content-type': 'application/json' }, payload: '{}' })

t.test('the attack of the issue on the default store: one tenant recording 1 MiB answers is refused at its share, every other tenant is still served', async (t) => {
  const { app, runs } = await echoApp(t, {})
  let refusedAt = -1
  for (let i = 0; i < 800 && refusedAt < 0; i++) {
    const res = await echo(app, 'mallory', `m-${i}`, MiB)
    if (res.statusCode === 503) refusedAt = i
    else if (res.statusCode !== 201) return t.fail(`mallory's request ${i} answered ${res.statusCode}`)
  }
  t.ok(refusedAt > 0, `mallory was refused after ${refusedAt} records`)
  t.ok(refusedAt <= 193, `at its share of the default 768 MiB (a quarter: 192 records of 1 MiB), not at the whole store (${refusedAt})`)
  t.equal(runs.get('mallory'), refusedAt, 'no refused request ran')

  for (const tenant of ['alice', 'bob']) {
    const first = await echo(app, tenant, 'order-1', 1024)
    t.equal(first.statusCode, 201, `${tenant} is served while mallory is at its share`)
    const again = await echo(app, tenant, 'order-1', 1024)
    t.equal(again.headers['idempotent-replayed'], 'true', `${tenant}'s record was kept`)
  }
  const early = await echo(app, 'mallory', 'm-0', MiB)
  t.equal(early.headers['idempotent-replayed'], 'true', 'mallory\'s own records are kept and replayed (none is dropped to make room)')
  t.equal(early.rawPayload.length, MiB)
  t.equal(runs.get('mallory'), refusedAt, 'and its operations ran once each')
})

t.test('a scope at its share of records is refused alone; its records are kept, and it is served again once they expire', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0, maxEntries: 100 })
  t.teardown(() => store.close())
  for (let i = 0; i < 25; i++) t.equal((await claim(store, 'a', `k${i}`)).outcome, 'acquired')
  // The 26th record of one scope is refused: a quarter of maxEntries by default.
  const refused = await refusal(t, claim(store, 'a', 'k25'))
  t.match(refused?.message, /maxEntriesPerScope: 25 records/, 'the error names the bound')
  t.equal(refused?.scoped, true, 'and says that only this scope is refused')
  t.equal(refused?.code, 'FST_IDEMPOTENCY_MEMORY_STORE_FULL')
  for (const scope of ['b', 'c', 'd']) {
    for (let i = 0; i < 25; i++) t.equal((await claim(store, scope, `k${i}`)).outcome, 'acquired', `${scope}/k${i}`)
  }
  for (let i = 0; i < 25; i++) t.equal((await store.get({ scope: 'a', key: `k${i}` }))?.state, 'in_progress', `a/k${i} kept`)
  t.equal((await claim(store, 'a', 'k0')).outcome, 'in_progress', 'a\'s existing keys still answer')
  // Four scopes at their share fill the store: the global bound still holds.
  t.equal((await refusal(t, claim(store, 'e', 'k0')))?.scoped, false, 'the whole store is full')
  clock.advance(61_000)
  t.equal((await claim(store, 'a', 'k25')).outcome, 'acquired', 'room is made from the scope\'s expired records')
})

t.test('a scope at its share of bytes is refused alone', async (t) => {
  const store = memoryStore({ purgeInterval: 0, maxBytes: 64 * 1024 })
  t.teardown(() => store.close())
  let recorded = 0
  for (;;) {
    const claimed = await claim(store, 'a', `k${recorded}`).catch((err: unknown) => err)
    if (claimed instanceof MemoryStoreFullError) {
      t.equal(claimed.scoped, true)
      t.match(claimed.message, /maxBytesPerScope: 16384 bytes/)
      break
    }
    if ((claimed as ClaimResult).outcome !== 'acquired') return t.fail('not acquired')
    await store.complete((claimed as ClaimResult & { outcome: 'acquired' }).lease, { statusCode: 200, headers: {}, body: Buffer.alloc(4000) }, 60_000)
    recorded++
  }
  t.ok(recorded >= 3 && recorded <= 5, `a quarter of 64 KiB holds ${recorded} records of 4,000 bytes`)
  await completed(t, store, 'b', 'k0', Buffer.alloc(4000))
  t.equal(store.usage().scopes, 2)
})

t.test('many small tenants are not hurt: only the whole store\'s bound refuses them', async (t) => {
  const store = memoryStore({ purgeInterval: 0, maxEntries: 1000 })
  t.teardown(() => store.close())
  for (let tenant = 0; tenant < 250; tenant++) {
    for (let i = 0; i < 4; i++) await completed(t, store, `tenant-${tenant}`, `k${i}`, Buffer.from('{"ok":true}'))
  }
  t.same(store.usage().records, 1000, '250 tenants × 4 records: the whole store, nobody refused')
  t.equal(store.usage().scopes, 250)
  t.equal((await refusal(t, claim(store, 'tenant-0', 'k4')))?.scoped, false, 'then the store is full for everyone')
})

t.test('\'\' (an unscoped app, or allowEmptyScope) is one shared bucket, bounded like any scope', async (t) => {
  const store = memoryStore({ purgeInterval: 0, maxEntries: 8 })
  t.teardown(() => store.close())
  t.equal((await claim(store, '', 'k0')).outcome, 'acquired')
  t.equal((await claim(store, '', 'k1')).outcome, 'acquired')
  const refused = await refusal(t, claim(store, '', 'k2'))
  t.equal(refused?.scoped, true)
  t.match(refused?.message, /maxEntriesPerScope: 2 records/)
  t.equal((await claim(store, 'acct', 'k2')).outcome, 'acquired', 'a named scope is served meanwhile')
  const whole = memoryStore({ purgeInterval: 0, maxEntries: 8, maxEntriesPerScope: 8 })
  t.teardown(() => whole.close())
  for (let i = 0; i < 8; i++) t.equal((await claim(whole, '', `k${i}`)).outcome, 'acquired', 'maxEntriesPerScope: maxEntries gives one scope the whole store')
})

t.test('a scope at its share keeps its in-progress and held records: nothing live is evicted', async (t) => {
  const store = memoryStore({ purgeInterval: 0, maxEntries: 8 })
  t.teardown(() => store.close())
  const first = await claim(store, 'a', 'held')
  const second = await claim(store, 'a', 'running')
  if (first.outcome !== 'acquired' || second.outcome !== 'acquired') return t.fail('not acquired')
  t.ok(await store.hold(first.lease))
  t.equal((await refusal(t, claim(store, 'a', 'third')))?.scoped, true)
  t.equal((await store.inspect({ scope: 'a', key: 'held' }))?.indeterminate, true, 'the held record is kept')
  t.equal((await store.get({ scope: 'a', key: 'running' }))?.state, 'in_progress', 'the in-progress record is kept')
  t.ok(await store.renew(second.lease, 30_000), 'and its owner still owns it')
})

t.test('the per-scope bounds are validated, naming the option and the value', async (t) => {
  t.throws(() => memoryStore({ maxEntriesPerScope: 0 }), { code: 'FST_IDEMPOTENCY_INVALID_OPTION', message: /memoryStore option "maxEntriesPerScope" must be an integer from 1 .*; received 0/ })
  t.throws(() => memoryStore({ maxBytesPerScope: 1.5 }), /memoryStore option "maxBytesPerScope" .*received 1\.5/)
  t.throws(() => memoryStore({ maxBytesPerScope: '1 MiB' as unknown as number }), /memoryStore option "maxBytesPerScope" .*received '1 MiB'/)
})
