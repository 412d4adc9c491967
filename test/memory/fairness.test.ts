import { createHash } from 'node:crypto'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, MemoryStoreFullError, type MemoryStore, type MemoryStoreOptions } from '../../lib/index.js'
import type { ClaimResult, Fingerprint } from '../../lib/core/store.js'
import { manualClock } from '../helpers/app.js'

/**
 * The memory store's shares (drivers/memory.ts, MemoryStoreOptions.maxEntriesPerScope). With one
 * global bound, one tenant that filled the store had every tenant answered 503 until its records
 * expired (768 requests of about 1 MiB to an echo route filled the default store in seconds). Each
 * scope is guaranteed a share (`maxEntriesPerScope`, `maxBytesPerScope`, a quarter of the store's
 * by default), which limits it only while other scopes compete: a scope beyond its share borrows
 * only room that no other scope holding records may still claim within its own. No live record of
 * any scope is ever dropped to make room.
 */

const fp: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('x').digest() }
const MiB = 1024 * 1024

function claim (store: MemoryStore, scope: string, key: string, ttlMs = 60_000): ClaimResult {
  return store.claim({ scope, key, fingerprint: fp, leaseMs: 30_000, ttlMs })
}

/** The MemoryStoreFullError `attempt` is refused with (a test failure if it is not refused so). */
function refusal (t: Test, attempt: () => unknown): MemoryStoreFullError | null {
  let err: unknown = null
  try { attempt() } catch (e) { err = e }
  t.type(err, MemoryStoreFullError, 'refused with MemoryStoreFullError')
  return err instanceof MemoryStoreFullError ? err : null
}

/** Claims and completes `key` with `body`; whether the body was kept whole. */
async function completed (t: Test, store: MemoryStore, scope: string, key: string, body: Buffer, ttlMs = 60_000): Promise<boolean> {
  const claimed = claim(store, scope, key, ttlMs)
  if (claimed.outcome !== 'acquired') throw new Error(`${scope}/${key}: ${claimed.outcome}`)
  t.ok(store.complete(claimed.lease, { statusCode: 201, headers: { 'content-type': 'application/octet-stream' }, body }, ttlMs))
  const record = await store.get({ scope, key })
  return record?.state === 'completed' && record.response.body?.length === body.length
}

/** An echo route answering `size` bytes, scoped by the `x-tenant` header, on the store given. */
async function echoApp (t: Test, options: MemoryStoreOptions): Promise<{ app: FastifyInstance, store: MemoryStore, runs: Map<string, number> }> {
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
  return { app, store, runs }
}

const echo = (app: FastifyInstance, tenant: string, key: string, size: number): Promise<LightMyRequestResponse> =>
  app.inject({ method: 'POST', url: `/echo?size=${size}`, headers: { 'x-tenant': tenant, 'idempotency-key': `"${key}"`, 'content-type': 'application/json' }, payload: '{}' })

t.test('the attack on the default store: a tenant recording 1 MiB answers borrows only what no active tenant may claim, and every active tenant keeps its share', async (t) => {
  const { app, store, runs } = await echoApp(t, {})
  const maxBytes = 768 * MiB
  // Alice and bob are active: they hold records when mallory starts.
  for (const tenant of ['alice', 'bob']) t.equal((await echo(app, tenant, 'order-1', 1024)).statusCode, 201, `${tenant}'s first request`)

  let retained = 0
  let requests = 0
  for (; requests < 800; requests++) {
    const before = store.usage().bytes
    const res = await echo(app, 'mallory', `m-${requests}`, MiB)
    if (res.statusCode !== 201) return t.fail(`mallory's request ${requests} answered ${res.statusCode}`)
    if (store.usage().bytes > maxBytes) return t.fail(`the store holds ${store.usage().bytes} bytes, past maxBytes`)
    if (store.usage().bytes - before < MiB) { requests++; break }
    retained++
  }
  t.ok(retained > 192, `alone beside two small tenants, mallory borrowed past its share of 192 MiB (${retained} answers of 1 MiB retained)`)
  t.ok(retained <= 768 - 2 * 192, `and left alice's and bob's shares free (${retained} answers retained, at most 384)`)
  t.equal(runs.get('mallory'), requests, 'each of mallory\'s requests ran once')
  const last = await echo(app, 'mallory', `m-${requests - 1}`, MiB)
  t.equal(last.statusCode, 410, 'the answer that did not fit was recorded without its body: a retry gets 410, never a second run')
  t.equal(runs.get('mallory'), requests)
  const early = await echo(app, 'mallory', 'm-0', MiB)
  t.equal(early.headers['idempotent-replayed'], 'true', 'mallory\'s own records are kept and replayed (none is dropped to make room)')
  t.equal(early.rawPayload.length, MiB)

  // Alice uses nearly her whole share (192 MiB, counted with each record's bookkeeping) while the
  // store is as full as mallory made it.
  let kept = 0
  for (let i = 0; i < 190; i++) {
    const res = await echo(app, 'alice', `a-${i}`, MiB)
    if (res.statusCode !== 201) return t.fail(`alice's request ${i} answered ${res.statusCode}`)
    const again = await store.get({ scope: 'alice', key: `a-${i}` })
    if (again?.state === 'completed' && again.response.body?.length === MiB) kept++
  }
  t.equal(kept, 190, 'alice recorded 190 answers of 1 MiB: her share was kept for her')
  const bob = await echo(app, 'bob', 'order-2', 1024)
  t.equal(bob.statusCode, 201, 'bob is served')
  t.equal((await echo(app, 'bob', 'order-1', 1024)).headers['idempotent-replayed'], 'true', 'bob\'s record was kept')
  t.ok(store.usage().bytes <= maxBytes, `the store holds at most maxBytes (${store.usage().bytes})`)
})

t.test('a newcomer (a scope holding no records) arriving after one scope filled the store is refused until records expire: nothing live is dropped for it', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0, maxEntries: 8 })
  t.teardown(() => store.close())
  for (let i = 0; i < 8; i++) t.equal(claim(store, 'a', `k${i}`).outcome, 'acquired', `a/k${i}: alone, a may use the whole store`)
  const refused = refusal(t, () => claim(store, 'newcomer', 'k0'))
  t.equal(refused?.scoped, false, 'the store is full: the newcomer is refused though it holds nothing')
  for (let i = 0; i < 8; i++) t.equal((await store.get({ scope: 'a', key: `k${i}` }))?.state, 'in_progress', `a/k${i} kept`)
  clock.advance(61_000)
  t.equal(claim(store, 'newcomer', 'k0').outcome, 'acquired', 'served once a\'s records expired')
})

t.test('one scope alone (no scope function) fills the store past a quarter of maxEntries without a 503', async (t) => {
  const store = memoryStore({ purgeInterval: 0, maxEntries: 40 })
  const app = Fastify()
  t.teardown(async () => { await app.close(); await store.close() })
  await app.register(idempotency, { store })
  let runs = 0
  app.post('/orders', async (request, reply) => reply.code(201).send({ order: ++runs }))
  const order = (key: string): Promise<LightMyRequestResponse> =>
    app.inject({ method: 'POST', url: '/orders', headers: { 'idempotency-key': `"${key}"`, 'content-type': 'application/json' }, payload: '{}' })
  const answers: number[] = []
  for (let i = 0; i < 40; i++) answers.push((await order(`k${i}`)).statusCode)
  t.same(answers, Array(40).fill(201), 'the whole store, 40 records, where the share is 10')
  t.equal(store.usage().scopes, 1)
  t.equal((await order('k40')).statusCode, 503, 'then the store is full')
  t.equal((await order('k0')).headers['idempotent-replayed'], 'true', 'and keeps replaying what it holds')
  t.equal(runs, 40)
})

t.test('a scope beyond its share borrows only room the other scopes holding records cannot claim; they then claim their shares whole', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 0, maxEntries: 100 })
  t.teardown(() => store.close())
  // b and c hold one record each: 24 more each are theirs to claim, so a may hold 100 - 2 - 48.
  t.equal(claim(store, 'b', 'k0').outcome, 'acquired')
  t.equal(claim(store, 'c', 'k0').outcome, 'acquired')
  for (let i = 0; i < 50; i++) t.equal(claim(store, 'a', `k${i}`).outcome, 'acquired', `a/k${i}`)
  const refused = refusal(t, () => claim(store, 'a', 'k50'))
  t.match(refused?.message, /maxEntriesPerScope: 25 records/, 'the error names the share')
  t.equal(refused?.scoped, true, 'and says that only this scope is refused')
  t.equal(refused?.code, 'FST_IDEMPOTENCY_MEMORY_STORE_FULL')
  for (const scope of ['b', 'c']) {
    for (let i = 1; i < 25; i++) t.equal(claim(store, scope, `k${i}`).outcome, 'acquired', `${scope}/k${i}: within its share, whatever a borrowed`)
  }
  t.equal(store.usage().records, 100)
  for (let i = 0; i < 50; i++) t.equal((await store.get({ scope: 'a', key: `k${i}` }))?.state, 'in_progress', `a/k${i} kept`)
  t.equal(claim(store, 'a', 'k0').outcome, 'in_progress', 'a\'s existing keys still answer')
  t.equal(refusal(t, () => claim(store, 'b', 'k25'))?.scoped, false, 'the store is full: the global bound holds')
  clock.advance(61_000)
  t.equal(claim(store, 'a', 'k50').outcome, 'acquired', 'room is made from expired records')
})

t.test('bytes: a scope beyond its share records answers only in room the other scopes holding records cannot claim', async (t) => {
  const maxBytes = 64 * 1024
  const store = memoryStore({ purgeInterval: 0, maxBytes })
  t.teardown(() => store.close())
  t.ok(await completed(t, store, 'b', 'k0', Buffer.alloc(100)), 'b holds a record')
  let kept = 0
  let recorded = 0
  for (;; recorded++) {
    let claimed: ClaimResult
    try {
      claimed = claim(store, 'a', `k${recorded}`)
    } catch (err) {
      t.type(err, MemoryStoreFullError)
      t.equal((err as MemoryStoreFullError).scoped, true, 'a\'s claims are refused once even its records without their answers do not fit beside b\'s share')
      t.match((err as MemoryStoreFullError).message, /maxBytesPerScope: 16384 bytes/)
      break
    }
    if (claimed.outcome !== 'acquired') return t.fail('not acquired')
    t.ok(store.complete(claimed.lease, { statusCode: 200, headers: {}, body: Buffer.alloc(4000) }, 60_000))
    const record = await store.get({ scope: 'a', key: `k${recorded}` })
    if (record?.state === 'completed' && record.response.body !== null) kept++
    t.ok(store.usage().bytes <= maxBytes)
  }
  t.ok(kept > 4 && kept <= 12, `a kept ${kept} answers of 4,000 bytes: past its share of 16 KiB, short of b's`)
  t.ok(recorded > kept, `the ${recorded - kept} answers that did not fit were recorded without their bodies`)
  for (let i = 1; i <= 3; i++) t.ok(await completed(t, store, 'b', `k${i}`, Buffer.alloc(4000)), `b records its answer ${i} of 4,000 bytes whole: within its share`)
  t.ok(store.usage().bytes <= maxBytes, `the store holds at most maxBytes (${store.usage().bytes})`)
})

t.test('many small tenants are not hurt: only the whole store\'s bound refuses them', async (t) => {
  const store = memoryStore({ purgeInterval: 0, maxEntries: 1000 })
  t.teardown(() => store.close())
  for (let tenant = 0; tenant < 250; tenant++) {
    for (let i = 0; i < 4; i++) await completed(t, store, `tenant-${tenant}`, `k${i}`, Buffer.from('{"ok":true}'))
  }
  t.same(store.usage().records, 1000, '250 tenants × 4 records: the whole store, nobody refused')
  t.equal(store.usage().scopes, 250)
  t.equal(refusal(t, () => claim(store, 'tenant-0', 'k4'))?.scoped, false, 'then the store is full for everyone')
})

t.test('\'\' (an unscoped app, or allowEmptyScope) is one bucket like any scope: alone it may use the whole store, beside others its share is kept for them', async (t) => {
  const store = memoryStore({ purgeInterval: 0, maxEntries: 8 })
  t.teardown(() => store.close())
  for (let i = 0; i < 8; i++) t.equal(claim(store, '', `k${i}`).outcome, 'acquired', `k${i}`)
  t.equal(refusal(t, () => claim(store, '', 'k8'))?.scoped, false, 'refused only when the store is full')

  const shared = memoryStore({ purgeInterval: 0, maxEntries: 8 })
  t.teardown(() => shared.close())
  t.equal(claim(shared, 'acct', 'k0').outcome, 'acquired', 'a named scope holds a record: one more of its share of 2 is kept for it')
  for (let i = 0; i < 6; i++) t.equal(claim(shared, '', `k${i}`).outcome, 'acquired', `k${i}`)
  const refused = refusal(t, () => claim(shared, '', 'k6'))
  t.equal(refused?.scoped, true)
  t.match(refused?.message, /maxEntriesPerScope: 2 records/)
  t.equal(claim(shared, 'acct', 'k1').outcome, 'acquired', 'the named scope claims its share')
})

t.test('a scope refused at its share keeps its in-progress and held records: nothing live is evicted', async (t) => {
  const store = memoryStore({ purgeInterval: 0, maxEntries: 8 })
  t.teardown(() => store.close())
  claim(store, 'b', 'k0')
  claim(store, 'c', 'k0')
  const first = claim(store, 'a', 'held')
  const second = claim(store, 'a', 'running')
  if (first.outcome !== 'acquired' || second.outcome !== 'acquired') return t.fail('not acquired')
  t.ok(store.hold(first.lease))
  // b and c may each claim one more record (a share of 2): a borrows up to 8 - 2 - 2.
  t.equal(claim(store, 'a', 'third').outcome, 'acquired')
  t.equal(claim(store, 'a', 'fourth').outcome, 'acquired')
  t.equal(refusal(t, () => claim(store, 'a', 'fifth'))?.scoped, true)
  t.equal((await store.inspect({ scope: 'a', key: 'held' }))?.indeterminate, true, 'the held record is kept')
  t.equal((await store.get({ scope: 'a', key: 'running' }))?.state, 'in_progress', 'the in-progress record is kept')
  t.ok(store.renew(second.lease, 30_000), 'and its owner still owns it')
})

t.test('the per-scope bounds are validated, naming the option and the value', async (t) => {
  t.throws(() => memoryStore({ maxEntriesPerScope: 0 }), { code: 'FST_IDEMPOTENCY_INVALID_OPTION', message: /memoryStore option "maxEntriesPerScope" must be an integer from 1 .*; received 0/ })
  t.throws(() => memoryStore({ maxBytesPerScope: 1.5 }), /memoryStore option "maxBytesPerScope" .*received 1\.5/)
  t.throws(() => memoryStore({ maxBytesPerScope: '1 MiB' as unknown as number }), /memoryStore option "maxBytesPerScope" .*received a string of 5 characters/)
})
