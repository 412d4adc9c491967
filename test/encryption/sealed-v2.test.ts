import { createHash, randomBytes } from 'node:crypto'
import Fastify, { type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, {
  InvalidOptionError, memoryStore, type EncryptionOptions, type Fingerprint, type IdempotencyOptions, type IdempotencyStore, type StoredResponse
} from '../../lib/index.js'
import { encryptedPrefilter, SealedResponseError } from '../../lib/core/encryption.js'
import { resolveKeyring } from '../../lib/core/keyring.js'
import type { IdempotencyPrefilter } from '../../lib/core/prefilter.js'
import { PROBLEM_TYPE } from '../helpers/app.js'

/*
 * For someone who can write to the store while `encryption` is on:
 * (a) a record stored in clear was replayed as genuine (unmarked records were taken as records
 *     from before encryption): anyone with write access could plant any answer;
 * (b) the fingerprint was not in the seal's additional data, so a sealed answer re-attached to
 *     another request's fingerprint opened, and that request got the other's answer instead of 422.
 * Sealed format v2 covers the fingerprint; a record in clear opens only with
 * `encryption.acceptUnsealed`, a v1 record (0.1, no fingerprint binding) only with
 * `encryption.acceptV1`: migration settings, off by default. A refused record is a 503, never a
 * re-execution, also with `onStoreError: 'bypass'`, and the status route answers 503 too.
 */

const KEY = randomBytes(32)
const ring = (extra: Partial<EncryptionOptions> = {}): EncryptionOptions => ({ keys: [{ id: 'k1', key: KEY }], ...extra })
const FORGED = '{"forged":"planted by someone with write access to the store"}'

interface World {
  readonly runs: Map<string, number>
  readonly pay: (key: string, amount?: number) => Promise<LightMyRequestResponse>
  readonly status: (key: string) => Promise<LightMyRequestResponse>
}

async function world (t: Test, store: IdempotencyStore, options: IdempotencyOptions, runs = new Map<string, number>()): Promise<World> {
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: () => 'tenant-a', statusRoute: { url: '/idempotency-keys/:key', includeBody: true }, ...options })
  app.post('/pay', async (request, reply) => {
    const key = request.idempotency?.key ?? ''
    runs.set(key, (runs.get(key) ?? 0) + 1)
    return reply.code(201).header('location', `/payments/${key}`).send({ paid: (request.body as { amount: number }).amount, charge: randomBytes(6).toString('hex') })
  })
  await app.ready()
  return {
    runs,
    pay: (key, amount = 100) => app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': `"${key}"` }, payload: { amount } }),
    status: (key) => app.inject({ method: 'GET', url: `/idempotency-keys/${key}` })
  }
}

function memory (t: Test): IdempotencyStore {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  return store
}

/** The fingerprint the plugin stores for `amount`, however it computes it: read from a record it wrote. */
async function fingerprintOf (t: Test, amount: number, options: IdempotencyOptions): Promise<Fingerprint> {
  const store = memory(t)
  await (await world(t, store, options)).pay('probe', amount)
  const record = await store.get({ scope: 'tenant-a', key: 'probe' })
  if (record === null) throw new Error('no probe record')
  return record.fingerprint
}

/** Writes a completed record straight into `store`, as someone with write access to it would. */
async function plant (store: IdempotencyStore, key: string, fingerprint: Fingerprint, response: StoredResponse): Promise<void> {
  const claimed = await store.claim({ scope: 'tenant-a', key, fingerprint, leaseMs: 60_000, ttlMs: 60_000 })
  if (claimed.outcome !== 'acquired' || !await store.complete(claimed.lease, response, 60_000)) throw new Error('could not plant')
}

function refused (t: Test, answer: LightMyRequestResponse, what: string): void {
  t.equal(answer.statusCode, 503, `${what}: 503`)
  t.equal((answer.json() as { type: string }).type, PROBLEM_TYPE('store-unavailable'), `${what}: store-unavailable`)
  t.notOk(answer.body.includes('forged'), `${what}: nothing of the record is sent`)
}

t.test('(a) a record planted in clear is not replayed while encryption is on: 503, the handler never runs', async (t) => {
  const options: IdempotencyOptions = { encryption: ring() }
  const fingerprint = await fingerprintOf(t, 100, options)
  const store = memory(t)
  await plant(store, 'planted', fingerprint, { statusCode: 200, headers: { 'content-type': 'application/json' }, body: Buffer.from(FORGED) })
  await plant(store, 'planted-null', fingerprint, { statusCode: 200, headers: { location: '/forged' }, body: null })

  const { runs, pay, status } = await world(t, store, options)
  refused(t, await pay('planted'), 'a replay')
  refused(t, await pay('planted-null'), 'a "not retained" record (no 410 from a planted record either)')
  refused(t, await status('planted'), 'the status route')
  t.equal(runs.get('planted'), undefined, 'the handler ran 0 times')

  const bypassing = await world(t, store, { ...options, onStoreError: 'bypass' })
  refused(t, await bypassing.pay('planted'), 'with onStoreError: bypass')
  t.equal(bypassing.runs.get('planted'), undefined, 'not even with onStoreError: bypass')
})

t.test('acceptUnsealed (the migration setting) replays records written before encryption was enabled', async (t) => {
  const store = memory(t)
  const runs = new Map<string, number>()
  const clear = await world(t, store, {}, runs)
  const original = await clear.pay('legacy')

  const strict = await world(t, store, { encryption: ring() }, runs)
  refused(t, await strict.pay('legacy'), 'by default')
  const migrating = await world(t, store, { encryption: ring({ acceptUnsealed: true }) }, runs)
  const replay = await migrating.pay('legacy')
  t.equal(replay.statusCode, 201)
  t.equal(replay.body, original.body, 'with acceptUnsealed: the record written in clear replays')
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal((await migrating.pay('legacy', 5)).statusCode, 422, 'and still tells a different request apart')
  t.equal(runs.get('legacy'), 1)
})

t.test('(b) a sealed answer re-attached to another request\'s fingerprint does not open: 503, not the other request\'s answer', async (t) => {
  const options: IdempotencyOptions = { encryption: ring() }
  const runs = new Map<string, number>()
  const original = memory(t)
  const first = await world(t, original, options, runs)
  t.equal((await first.pay('k', 100)).statusCode, 201)
  const sealed = await original.get({ scope: 'tenant-a', key: 'k' })
  if (sealed?.state !== 'completed') throw new Error('not recorded')
  const other = await fingerprintOf(t, 5, options)
  t.notSame(other.digest, sealed.fingerprint.digest, 'two requests, two fingerprints')

  // The same (scope, key), the same sealed bytes, the fingerprint of the request `amount: 5`.
  const tampered = memory(t)
  await plant(tampered, 'k', other, sealed.response)
  const { pay, status } = await world(t, tampered, options, runs)
  const answer = await pay('k', 5)
  t.not(answer.statusCode, 201, 'the request `amount: 5` does not get the answer to `amount: 100`')
  refused(t, answer, 'a moved seal')
  refused(t, await status('k'), 'the status route')
  t.equal(runs.get('k'), 1, 'never executed again')

  // The algorithm is covered too, not only the digest.
  const relabelled = memory(t)
  await plant(relabelled, 'k', { algorithm: `${sealed.fingerprint.algorithm}-x`, digest: sealed.fingerprint.digest }, sealed.response)
  refused(t, await (await world(t, relabelled, options, runs)).status('k'), 'another algorithm')
})

// Sealed by fastify-idempotency 0.1 (format v1, commit f203b40) under FIXTURE_KEY for
// (tenant-a, v1-record) and (tenant-a, v1-not-retained).
const FIXTURE_KEY = createHash('sha256').update('fastify-idempotency v1 fixture key').digest()
const V1_RETAINED: StoredResponse = {
  statusCode: 201,
  headers: { 'fastify-idempotency/sealed': 'v1.fixture' },
  body: Buffer.from('1ROPLH5rsmvPbKVjpGqaLSaR7LE/K9SUCbFn6h3bfKeGs+juNQwoFKrwORRzGaeUq6UVm22uxJkaVJ6EbS7OWYizrZlCQ9Yzo87E7tnuELYzaw3sBIOJ9y6Y/Ja84nc1KzKoH4cC6ipr/tEhcabmXZW00nvzbasoy98SRSIMkitx', 'base64')
}
const V1_NOT_RETAINED: StoredResponse = {
  statusCode: 202,
  headers: { 'fastify-idempotency/sealed': 'v1.fixture.u6iKbZkgPwDcYPXRvWRTPj3hL53fuDolVHAUvoqrnlEJ7NGHvoWR-N9o9tgBaekFZHHw0nvclw' },
  body: null
}
const fixtureRing = (extra: Partial<EncryptionOptions> = {}): EncryptionOptions => ({ keys: [{ id: 'fixture', key: FIXTURE_KEY }], ...extra })

t.test('v1 records (0.1): refused by default; acceptV1 opens them during the migration, whatever fingerprint they hold', async (t) => {
  const fingerprint = await fingerprintOf(t, 100, { encryption: fixtureRing() })
  const store = memory(t)
  await plant(store, 'v1-record', fingerprint, V1_RETAINED)
  await plant(store, 'v1-not-retained', fingerprint, V1_NOT_RETAINED)
  const runs = new Map<string, number>()

  const strict = await world(t, store, { encryption: fixtureRing() }, runs)
  refused(t, await strict.pay('v1-record'), 'a v1 record by default')
  refused(t, await strict.pay('v1-not-retained'), 'a v1 "not retained" record by default')

  const migrating = await world(t, store, { encryption: fixtureRing({ acceptV1: true }) }, runs)
  const replay = await migrating.pay('v1-record')
  t.equal(replay.statusCode, 201)
  t.equal(replay.body, '{"sealed":"by 0.1.0"}', 'the v1 record opens with acceptV1: byte for byte what 0.1 sealed')
  t.equal(replay.headers.location, '/payments/v1')
  t.equal(replay.headers['idempotent-replayed'], 'true')
  const gone = await migrating.pay('v1-not-retained')
  t.equal(gone.statusCode, 410)
  t.equal((gone.json() as { originalStatus: number }).originalStatus, 202)
  t.equal(runs.size, 0, 'no handler ran')

  // Why it is off by default: v1 does not cover the fingerprint.
  const other = await fingerprintOf(t, 5, { encryption: fixtureRing() })
  const moved = memory(t)
  await plant(moved, 'v1-record', other, V1_RETAINED)
  const exposed = await world(t, moved, { encryption: fixtureRing({ acceptV1: true }) }, runs)
  t.equal((await exposed.pay('v1-record', 5)).statusCode, 201, 'with acceptV1, a v1 answer re-attached to another fingerprint still opens (the documented limit)')
})

t.test('the migration settings are validated at registration, naming the option and the value', async (t) => {
  for (const [extra, option, received] of [
    [{ acceptUnsealed: 'yes' }, 'option "encryption".acceptUnsealed', 'a string of 3 characters'],
    [{ acceptV1: 1 }, 'option "encryption".acceptV1', '1']
  ] as const) {
    const app = Fastify()
    t.teardown(() => app.close())
    const err = await app.register(idempotency, { store: memory(t), encryption: ring(extra as never) }).then(() => null, (e: unknown) => e)
    t.type(err, InvalidOptionError)
    t.equal((err as InvalidOptionError).option, option)
    t.match((err as Error).message, `${option} must be true or false; received ${received}`)
  }
})

t.test('the pre-filter: a copy planted in clear is a miss (the store answers), never a replay', async (t) => {
  const fingerprint: Fingerprint = { algorithm: 'raw-v1', digest: Buffer.alloc(32, 7) }
  const planted: IdempotencyPrefilter = {
    lookup: async () => ({ state: 'completed', fingerprint, response: { statusCode: 200, headers: {}, body: Buffer.from(FORGED) } }),
    markInFlight: async () => {},
    clearInFlight: async () => {},
    remember: async () => {},
    close: async () => {}
  }
  await t.rejects(encryptedPrefilter(resolveKeyring(ring()), planted).lookup({ scope: 'tenant-a', key: 'k' }), SealedResponseError)
  const migrating = await encryptedPrefilter(resolveKeyring(ring({ acceptUnsealed: true })), planted).lookup({ scope: 'tenant-a', key: 'k' })
  t.equal(migrating?.state === 'completed' && migrating.response.body?.toString(), FORGED, 'read as a record from before encryption with acceptUnsealed')
})
