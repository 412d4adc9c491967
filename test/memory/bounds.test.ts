import assert from 'node:assert/strict'
import { createHash } from 'node:crypto'
import fc from 'fast-check'
import Fastify, { type LightMyRequestResponse } from 'fastify'
import t from 'tap'
import idempotency, { memoryStore, MemoryStoreFullError, type MemoryStoreOptions } from '../../lib/index.js'
import type { ClaimRequest, Fingerprint, IdempotencyStore, Lease } from '../../lib/core/store.js'
import { fcParams } from '../adversarial/support.js'
import { deferred, eventually } from '../helpers/app.js'

/**
 * The memory store's byte and record bounds hold for what it holds, at every moment and under
 * concurrency (drivers/memory.ts, MemoryStoreOptions.maxBytes). A response is only known once its
 * handler ran, so it cannot be refused: one that does not fit is recorded without its body (a retry
 * gets 410, never a second run), and its claim counted the room for that. A step result that does
 * not fit is refused. The shares (test/memory/fairness.test.ts) apply to all three.
 */

const fp: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('x').digest() }
const NOT_RETAINED = 'tag:fastify-idempotency,2026:response-not-retained'

t.test('40 concurrent answers of 200 KB from one scope on a 1 MB store: it never holds more than its bounds, each operation runs once, and another tenant is served', async (t) => {
  const maxBytes = 1_000_000
  const inner = memoryStore({ purgeInterval: 0, maxBytes })
  // What the store holds after each claim and completion, seen through a wrapper the plugin calls.
  const held: number[] = []
  const store: IdempotencyStore = {
    ...inner,
    claim: (request) => {
      try { return inner.claim(request) } finally { held.push(inner.usage().bytes) }
    },
    complete: (lease, response, ttlMs) => {
      try { return inner.complete(lease, response, ttlMs) } finally { held.push(inner.usage().bytes) }
    }
  }
  const app = Fastify()
  t.teardown(async () => { await app.close(); await inner.close() })
  await app.register(idempotency, { store, scope: (request) => String(request.headers['x-tenant']) })
  const gate = deferred()
  const runs = new Map<string, number>()
  let inFlight = 0
  app.post('/reports', async (request, reply) => {
    const key = `${String(request.headers['x-tenant'])} ${String(request.headers['idempotency-key'])}`
    runs.set(key, (runs.get(key) ?? 0) + 1)
    inFlight++
    await gate.promise
    return reply.code(201).type('application/octet-stream').send(Buffer.alloc(200_000, 'r'))
  })
  const post = (tenant: string, key: string): Promise<LightMyRequestResponse> =>
    app.inject({ method: 'POST', url: '/reports', headers: { 'x-tenant': tenant, 'idempotency-key': `"${key}"`, 'content-type': 'application/json' }, payload: '{}' })

  const first = Array.from({ length: 40 }, (_, i) => post('mallory', `r-${i}`))
  t.ok(await eventually(() => inFlight === 40), 'all 40 are in flight at once')
  gate.resolve()
  const answers = await Promise.all(first)
  t.same(answers.map((res) => res.statusCode), Array(40).fill(201), 'each client got its 201')
  t.ok(answers.every((res) => res.rawPayload.length === 200_000), 'with its whole body')
  t.ok(held.length >= 80, `the bytes held were seen after every claim and completion (${held.length})`)
  t.ok(held.every((bytes) => bytes <= maxBytes), `and never passed maxBytes (at most ${Math.max(...held)} of ${maxBytes})`)
  t.ok(inner.usage().bytes <= maxBytes, `the store holds ${inner.usage().bytes} bytes`)

  let replayed = 0
  let notRetained = 0
  for (let i = 0; i < 40; i++) {
    const again = await post('mallory', `r-${i}`)
    if (again.statusCode === 201 && again.headers['idempotent-replayed'] === 'true' && again.rawPayload.length === 200_000) replayed++
    else if (again.statusCode === 410 && (JSON.parse(again.body) as { type?: string }).type === NOT_RETAINED) notRetained++
    else t.fail(`the retry of r-${i} answered ${again.statusCode}`)
  }
  t.equal(replayed + notRetained, 40, `each retry got its replay (${replayed}) or the 410 problem (${notRetained})`)
  t.ok(replayed >= 1 && notRetained >= 1, 'the answers that fitted were kept whole, the others were recorded without their bodies')
  t.same([...runs.values()], Array(40).fill(1), 'each of the 40 ran once, retries included')

  const other = await post('alice', 'order-1')
  t.equal(other.statusCode, 201, 'another tenant\'s first request is served')
  const retried = await post('alice', 'order-1')
  t.ok(retried.headers['idempotent-replayed'] === 'true' || retried.statusCode === 410, `and its outcome recorded (its retry answered ${retried.statusCode})`)
  t.equal(runs.get('alice "order-1"'), 1, 'it ran once')
  t.ok(inner.usage().bytes <= maxBytes)
})

t.test('recording an outcome needs no more room than its claim counted, steps or not', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  for (const key of ['k', 'a much longer key, up to what a client may send: '.padEnd(200, 'x'), 'ünïcødé ✓']) {
    const before = store.usage().bytes
    const claim = store.claim({ scope: 'tenant', key, fingerprint: fp, leaseMs: 1000, ttlMs: 60_000 })
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    const claimed = store.usage().bytes
    await store.saveStep(claim.lease, 'charge', '{"id":"ch_1"}')
    t.ok(store.complete(claim.lease, { statusCode: 500, headers: {}, body: null }, 60_000))
    t.ok(store.usage().bytes <= claimed, `${key.length} characters: ${store.usage().bytes - before} bytes recorded, ${claimed - before} counted at the claim`)
  }
})

t.test('a step result that does not fit is refused with MemoryStoreFullError: nothing is recorded, and the lease is kept', async (t) => {
  const store = memoryStore({ purgeInterval: 0, maxBytes: 8192 })
  t.teardown(() => store.close())
  const claim = store.claim({ scope: 'tenant', key: 'k', fingerprint: fp, leaseMs: 1000, ttlMs: 60_000 })
  if (claim.outcome !== 'acquired') return t.fail('not acquired')
  t.equal(await store.saveStep(claim.lease, 'small', '{"ok":true}'), true)
  await t.rejects(store.saveStep(claim.lease, 'large', JSON.stringify('x'.repeat(8192))), MemoryStoreFullError)
  t.same(await store.loadSteps(claim.lease), { small: { ok: true } }, 'the refused step is not recorded')
  t.equal(store.renew(claim.lease, 1000), true, 'the lease is still owned: a refusal is not a lost lease')
  t.ok(store.usage().bytes <= 8192)

  // The shares apply to steps too: beside a scope holding records, one beyond its share is refused.
  const shared = memoryStore({ purgeInterval: 0, maxBytes: 8192 })
  t.teardown(() => shared.close())
  shared.claim({ scope: 'other', key: 'k', fingerprint: fp, leaseMs: 1000, ttlMs: 60_000 })
  const mine = shared.claim({ scope: 'tenant', key: 'k', fingerprint: fp, leaseMs: 1000, ttlMs: 60_000 })
  if (mine.outcome !== 'acquired') return t.fail('not acquired')
  const step = JSON.stringify('x'.repeat(1500))
  t.equal(await shared.saveStep(mine.lease, 'one', step), true, 'within its share of 2,048 bytes')
  const refused = await shared.saveStep(mine.lease, 'two', step).catch((err: unknown) => err)
  t.type(refused, MemoryStoreFullError)
  t.equal((refused as MemoryStoreFullError).scoped, true, 'past it, with the rest kept for the other scope')
})

t.test('through the plugin, a step whose result the store refuses holds the key: the operation never runs again', async (t) => {
  const store = memoryStore({ purgeInterval: 0, maxBytes: 16_384 })
  const app = Fastify()
  t.teardown(async () => { await app.close(); await store.close() })
  await app.register(idempotency, { store, scope: () => 'tenant' })
  let handled = 0
  let charged = 0
  app.post('/charge', async (request, reply) => {
    handled++
    const receipt = await request.idempotency?.step('charge', async () => { charged++; return 'r'.repeat(20_000) })
    return reply.code(201).send({ receipt: String(receipt).length })
  })
  const charge = (): Promise<LightMyRequestResponse> =>
    app.inject({ method: 'POST', url: '/charge', headers: { 'idempotency-key': '"c-1"', 'content-type': 'application/json' }, payload: '{}' })
  const first = await charge()
  t.ok(first.statusCode >= 500, `the request failed (${first.statusCode})`)
  t.equal((await store.inspect({ scope: 'tenant', key: 'c-1' }))?.indeterminate, true, 'the key is held for the reconciler, not released')
  const retry = await charge()
  t.ok(retry.statusCode >= 400, `a retry is refused (${retry.statusCode})`)
  t.equal(charged, 1, 'the step\'s effect happened once')
  t.equal(handled, 1, 'and the handler never ran again')
})

// ---------------------------------------------------------------------------------------------
// A property: random requests across a few scopes, interleaved at random

interface RequestSpec {
  readonly scope: number
  readonly key: number
  readonly steps: readonly number[]
  readonly end: { readonly kind: 'complete', readonly body: number, readonly pad: number } | { readonly kind: 'release' }
}

const SCOPES = ['a', 'b', 'c', 'd']
/** More than any claim of these tests counts (its record completed without a response: 434 bytes). */
const CLAIM_AT_MOST = 512
/** Bytes a completed record counts beyond its headers and body, at most: its row (304), memory of its own (96), a key of 2 bytes, a digest of 32. */
const COMPLETED_AT_MOST = 304 + 96 + 2 + 32

const configArb = fc.record({
  maxEntries: fc.integer({ min: 2, max: 24 }),
  maxBytes: fc.integer({ min: 2000, max: 40_000 }),
  share: fc.option(fc.double({ min: 0.1, max: 1, noNaN: true }), { nil: undefined })
})

const requestArb: fc.Arbitrary<RequestSpec> = fc.record({
  scope: fc.integer({ min: 0, max: SCOPES.length - 1 }),
  key: fc.integer({ min: 0, max: 5 }),
  steps: fc.array(fc.integer({ min: 0, max: 1500 }), { maxLength: 2 }),
  end: fc.oneof(
    fc.record({ kind: fc.constant('complete' as const), body: fc.oneof(fc.integer({ min: 0, max: 6000 }), fc.constant(0)), pad: fc.integer({ min: 0, max: 600 }) }),
    fc.record({ kind: fc.constant('release' as const) })
  )
})

/** How often the runs went where the bounds and shares decide: the property is not vacuous. */
const seen = { refusedClaims: 0, refusedSteps: 0, notRetained: 0, retained: 0, borrowedRecords: 0, borrowedBytes: 0, interleaved: 0 }

const params = fcParams(0x6d656d, 300)

t.test('property: under random interleavings of claims, steps, completions and releases across scopes, the bounds hold after every operation, nobody is refused within its share while the store has room, and nothing live is dropped', async (t) => {
  await fc.assert(fc.asyncProperty(fc.scheduler(), configArb, fc.array(requestArb, { minLength: 1, maxLength: 24 }), async (s, config, specs) => {
    const options: MemoryStoreOptions = {
      purgeInterval: 0,
      maxEntries: config.maxEntries,
      maxBytes: config.maxBytes,
      ...(config.share === undefined ? {} : { maxEntriesPerScope: Math.max(1, Math.round(config.maxEntries * config.share)), maxBytesPerScope: Math.max(1, Math.round(config.maxBytes * config.share)) })
    }
    const store = memoryStore(options)
    const maxEntries = config.maxEntries
    const maxBytes = config.maxBytes
    const recordShare = options.maxEntriesPerScope ?? Math.max(1, Math.floor(maxEntries / 4))
    const byteShare = options.maxBytesPerScope ?? Math.max(1, Math.floor(maxBytes / 4))
    try {
      // What each scope holds, from the store's own count before and after each operation (each
      // operation changes one scope's records only: nothing expires here).
      const records = new Map<string, number>(SCOPES.map((scope) => [scope, 0]))
      const bytes = new Map<string, number>(SCOPES.map((scope) => [scope, 0]))
      /** Records in progress: their lease and the bytes they count. */
      const open = new Map<string, { lease: Lease, bytes: number }>()
      /** Completed records: the body a replay must return (null: not retained). */
      const done = new Map<string, Buffer | null>()
      const request = (scope: string, key: string): ClaimRequest => ({ scope, key, fingerprint: fp, leaseMs: 3_600_000, ttlMs: 3_600_000 })

      /** Runs one operation of `scope`, counting what it changed to that scope. */
      function act<T> (scope: string, operation: () => T): { value: T | undefined, error: unknown, records: number, bytes: number } {
        const before = store.usage()
        let value: T | undefined
        let error: unknown = null
        try { value = operation() } catch (err) { error = err }
        const after = store.usage()
        const changed = { value, error, records: after.records - before.records, bytes: after.bytes - before.bytes }
        records.set(scope, (records.get(scope) ?? 0) + changed.records)
        bytes.set(scope, (bytes.get(scope) ?? 0) + changed.bytes)
        return changed
      }
      const sum = (of: Map<string, number>): number => [...of.values()].reduce((a, b) => a + b, 0)

      /** A scope past its share after growing may only have borrowed room no other scope holding records may claim. */
      function borrowedFairly (scope: string, of: Map<string, number>, share: number, capacity: number, what: string): void {
        assert.ok(sum(of) <= capacity, `${scope}: ${sum(of)} ${what} held, past the store's bound of ${capacity}`)
        if ((of.get(scope) ?? 0) <= share) return
        if (of === records) seen.borrowedRecords++
        else seen.borrowedBytes++
        let reserve = 0
        for (const other of SCOPES) if (other !== scope && (records.get(other) ?? 0) > 0) reserve += Math.max(0, share - (of.get(other) ?? 0))
        assert.ok(sum(of) + reserve <= capacity, `${scope} borrowed ${what} into the others' shares: ${sum(of)} held, ${reserve} reserved, ${capacity} in all`)
      }

      function invariants (where: string): void {
        const usage = store.usage()
        assert.ok(usage.bytes <= maxBytes, `${where}: ${usage.bytes} bytes held, maxBytes ${maxBytes}`)
        assert.ok(usage.records <= maxEntries, `${where}: ${usage.records} records held, maxEntries ${maxEntries}`)
        assert.equal(usage.bytes, sum(bytes), `${where}: every byte counted is some scope's`)
        assert.equal(usage.records, sum(records))
        for (const [id, body] of done) {
          const [scope, key] = id.split('/') as [string, string]
          const replay = store.claim(request(scope, key))
          assert.equal(replay.outcome, 'completed', `${where}: ${id} was completed and is still there`)
          if (replay.outcome !== 'completed') return
          if (body === null) assert.equal(replay.response.body, null, `${where}: ${id} reports not retained`)
          else assert.ok(replay.response.body?.equals(body), `${where}: ${id} replays its body`)
        }
        for (const id of open.keys()) {
          const [scope, key] = id.split('/') as [string, string]
          assert.equal(store.claim(request(scope, key)).outcome, 'in_progress', `${where}: ${id} is still in progress`)
        }
      }

      async function run (spec: RequestSpec, index: number): Promise<void> {
        const scope = SCOPES[spec.scope] as string
        const key = `k${spec.key}`
        const id = `${scope}/${key}`
        await s.schedule(Promise.resolve(), `${index}: claim ${id}`)
        const claimed = act(scope, () => store.claim(request(scope, key)))
        if (claimed.error !== null) {
          assert.ok(claimed.error instanceof MemoryStoreFullError, String(claimed.error))
          const room = sum(records) + 1 <= maxEntries && sum(bytes) + CLAIM_AT_MOST <= maxBytes
          const withinShare = (records.get(scope) ?? 0) + 1 <= recordShare && (bytes.get(scope) ?? 0) + CLAIM_AT_MOST <= byteShare
          assert.ok(!(room && withinShare), `${index}: ${scope} was refused a claim within its share while the store had room`)
          seen.refusedClaims++
          invariants(`${index}: refused claim`)
          return
        }
        const result = claimed.value
        if (result?.outcome !== 'acquired') { invariants(`${index}: ${result?.outcome ?? ''}`); return }
        borrowedFairly(scope, records, recordShare, maxEntries, 'records')
        borrowedFairly(scope, bytes, byteShare, maxBytes, 'bytes')
        const entry = { lease: result.lease, bytes: claimed.bytes }
        open.set(id, entry)
        if (open.size > 1) seen.interleaved++
        invariants(`${index}: claim`)

        for (const [step, size] of spec.steps.entries()) {
          await s.schedule(Promise.resolve(), `${index}: step ${step} of ${id}`)
          const name = `s${step}`
          const json = JSON.stringify('j'.repeat(size))
          const saving = act(scope, () => store.saveStep(entry.lease, name, json))
          const saved = await (saving.value as Promise<boolean>).catch((err: unknown) => err)
          if (saved === true) {
            entry.bytes += saving.bytes
            if (saving.bytes > 0) borrowedFairly(scope, bytes, byteShare, maxBytes, 'bytes')
          } else {
            assert.ok(saved instanceof MemoryStoreFullError, `${index}: step ${String(saved)}`)
            assert.equal(saving.bytes, 0, 'a refused step counts nothing')
            const size = (name.length + json.length) * 2
            const room = sum(bytes) + size <= maxBytes
            const withinShare = (bytes.get(scope) ?? 0) + size <= byteShare
            assert.ok(!(room && withinShare), `${index}: ${scope} was refused a step within its share while the store had room`)
            seen.refusedSteps++
          }
          invariants(`${index}: step ${step}`)
        }

        await s.schedule(Promise.resolve(), `${index}: ${spec.end.kind} ${id}`)
        open.delete(id)
        if (spec.end.kind === 'release') {
          assert.equal(act(scope, () => store.release(entry.lease)).value, true)
          invariants(`${index}: release`)
          return
        }
        const body = Buffer.alloc(spec.end.body, index)
        const headers: Record<string, string> = { 'content-type': 'application/octet-stream' }
        if (spec.end.pad > 0) headers['x-pad'] = 'p'.repeat(spec.end.pad)
        const headerBytes = Object.entries(headers).reduce((total, [name, value]) => total + name.length + value.length, 0)
        const completing = act(scope, () => store.complete(entry.lease, { statusCode: 201, headers, body }, 3_600_000))
        assert.equal(completing.value, true, `${index}: complete`)
        const recorded = store.claim(request(scope, key))
        assert.equal(recorded.outcome, 'completed')
        const kept = recorded.outcome === 'completed' ? recorded.response.body : null
        if (kept === null) {
          assert.ok(completing.bytes <= 0, 'an outcome recorded without its body needs no more than its claim counted')
          const whole = COMPLETED_AT_MOST + headerBytes + body.length
          const before = (bytes.get(scope) ?? 0) - completing.bytes
          const room = sum(bytes) - completing.bytes - entry.bytes + whole <= maxBytes
          const withinShare = before - entry.bytes + whole <= byteShare
          assert.ok(!(room && withinShare), `${index}: ${scope}'s answer of ${body.length} bytes was not retained though it fitted its share and the store`)
          seen.notRetained++
        } else {
          seen.retained++
          assert.ok(kept.equals(body), 'a retained body is the body')
          if (completing.bytes > 0) borrowedFairly(scope, bytes, byteShare, maxBytes, 'bytes')
        }
        done.set(id, kept === null ? null : body)
        invariants(`${index}: complete`)
      }

      await s.waitFor(Promise.all(specs.map(run)))
      assert.equal(open.size, 0)
      invariants('the end')
    } finally {
      await store.close()
    }
  }), params)
  t.comment(JSON.stringify(seen))
  if (params.numRuns >= 300) for (const [path, count] of Object.entries(seen)) t.ok(count >= 20, `the runs went through it: ${path} (${count})`)
})
