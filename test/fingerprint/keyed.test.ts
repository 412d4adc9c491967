import { createHash, createHmac, hkdfSync, randomBytes } from 'node:crypto'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type EncryptionOptions, type Fingerprint, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import { postgresStore } from '../../drivers/postgres/index.js'
import { resolveKeyring } from '../../lib/core/keyring.js'
import { keyed, manualClock, PROBLEM_TYPE } from '../helpers/app.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/*
 * The stored fingerprint was an unkeyed SHA-256 of a documented form of the
 * request, in clear even with encryption on, so whoever reads the store could confirm guesses
 * about a body (a card number from its BIN and last four, in under a second). With `encryption`,
 * the stored fingerprint is HMAC-SHA-256 under a key derived from the encryption key (HKDF, info
 * "fastify-idempotency fingerprint v1") of the unkeyed digest, named hmac-<algorithm>.<key id>;
 * a retry across a key rotation is still recognised as the same request. The expected values are
 * computed here from node:crypto alone, not with the plugin's own functions.
 */

const K1 = randomBytes(32)
const K2 = randomBytes(32)
const K0 = randomBytes(32)
const KEYS = { k0: K0, k1: K1, k2: K2 } as const
type KeyId = keyof typeof KEYS
const ring = (...ids: KeyId[]): EncryptionOptions => ({ keys: ids.map((id) => ({ id, key: KEYS[id] })) })

const PAN = '4242424242424242'
const BODY = { card: PAN, amount: 100 }
/** canonical-v1's input for POST /pay with BODY: members sorted, nothing else. */
const CANONICAL_INPUT = `POST\n/pay\njson:{"amount":100,"card":"${PAN}"}`

const sha256 = (input: string | Buffer): Buffer => createHash('sha256').update(input).digest()
const macKey = (id: KeyId): Buffer => Buffer.from(hkdfSync('sha256', KEYS[id], Buffer.alloc(0), 'fastify-idempotency fingerprint v1', 32))
const hmac = (id: KeyId, unkeyed: Buffer): Buffer => createHmac('sha256', macKey(id)).update(unkeyed).digest()
const keyedCanonical = (id: KeyId, input = CANONICAL_INPUT): Fingerprint => ({ algorithm: `hmac-canonical-v1.${id}`, digest: hmac(id, sha256(input)) })

/**
 * `keys` with unsealed records accepted (`acceptUnsealed`, the migration setting of sealed format v2) where the keyring has that setting; before it, they always were.
 */
function migrating (keys: EncryptionOptions): EncryptionOptions {
  const withSetting = { ...keys, acceptUnsealed: true }
  try {
    resolveKeyring(withSetting)
    return withSetting
  } catch {
    return keys
  }
}

interface World {
  readonly app: FastifyInstance
  readonly runs: () => number
  readonly pay: (key: string, body?: unknown) => Promise<LightMyRequestResponse>
}

async function world (t: Test, store: IdempotencyStore, options: IdempotencyOptions = {}): Promise<World> {
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { scope: () => 'test', store, ...options })
  let runs = 0
  app.post('/pay', async (_request, reply) => reply.code(201).send({ id: `ch_${++runs}` }))
  app.post('/raw', { config: { idempotency: { fingerprint: 'raw' } } }, async (_request, reply) => reply.code(201).send({ id: `ch_${++runs}` }))
  app.post('/custom', { config: { idempotency: { fingerprint: (request) => `order:${(request.body as { card: string }).card}` } } },
    async (_request, reply) => reply.code(201).send({ id: `ch_${++runs}` }))
  return {
    app,
    runs: () => runs,
    pay: (key, body = BODY) => app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: body as object })
  }
}

function memory (t: Test, now?: () => number): IdempotencyStore {
  const store = memoryStore({ purgeInterval: 0, ...(now === undefined ? {} : { now }) })
  t.teardown(() => store.close())
  return store
}

async function storedFingerprint (store: IdempotencyStore, key: string): Promise<Fingerprint> {
  const record = await store.get({ scope: 'test', key })
  if (record === null) throw new Error(`no record for ${key}`)
  return record.fingerprint
}

t.test('with encryption, the stored fingerprint is not the unkeyed SHA-256 of the canonical form: it is the HMAC', async (t) => {
  const store = memory(t)
  const { pay } = await world(t, store, { encryption: ring('k1') })
  t.equal((await pay('card-1')).statusCode, 201)
  const stored = await storedFingerprint(store, 'card-1')
  t.notOk(stored.digest.equals(sha256(CANONICAL_INPUT)), 'not the guessable hash of the request')
  t.equal(stored.algorithm, 'hmac-canonical-v1.k1', 'the algorithm names the keyed form and the key')
  t.equal(stored.digest.toString('hex'), keyedCanonical('k1').digest.toString('hex'), 'HMAC-SHA-256(HKDF(k1), SHA-256(canonical input))')

  // The attack of the finding: every candidate card with a known BIN and last four, hashed the
  // documented way, never matches what the store holds.
  const candidates = Array.from({ length: 1000 }, (_, i) => `424242${String(i).padStart(6, '0')}4242`)
  candidates.push(PAN)
  const confirmed = candidates.filter((pan) => sha256(`POST\n/pay\njson:{"amount":100,"card":"${pan}"}`).equals(stored.digest))
  t.same(confirmed, [], 'no guess is confirmed from the stored fingerprint')
})

t.test('with encryption, raw and custom fingerprints are keyed too', async (t) => {
  const store = memory(t)
  const { app } = await world(t, store, { encryption: ring('k1') })
  const text = `{"card":"${PAN}"}`
  const headers = { ...keyed('raw-1'), 'content-type': 'application/json' }
  t.equal((await app.inject({ method: 'POST', url: '/raw', headers, payload: text })).statusCode, 201)
  const raw = await storedFingerprint(store, 'raw-1')
  t.equal(raw.algorithm, 'hmac-raw-v1.k1')
  t.notOk(raw.digest.equals(sha256(`POST\n/raw\n${text}`)), 'raw: not the unkeyed hash')
  t.ok(raw.digest.equals(hmac('k1', sha256(`POST\n/raw\n${text}`))), 'raw: the HMAC of raw-v1')

  t.equal((await app.inject({ method: 'POST', url: '/custom', headers: keyed('custom-1'), payload: { card: PAN } })).statusCode, 201)
  const custom = await storedFingerprint(store, 'custom-1')
  t.equal(custom.algorithm, 'hmac-custom-v1.k1')
  t.notOk(custom.digest.equals(sha256(`order:${PAN}`)), 'custom: not the unkeyed hash')
  t.ok(custom.digest.equals(hmac('k1', sha256(`order:${PAN}`))), 'custom: the HMAC of custom-v1')
})

t.test('with encryption, retries still replay and a different body is still 422', async (t) => {
  const { pay, runs } = await world(t, memory(t), { encryption: ring('k1') })
  const first = await pay('same')
  const again = await pay('same', { amount: 100, card: PAN })
  t.equal(again.statusCode, 201)
  t.equal(again.headers['idempotent-replayed'], 'true')
  t.equal(again.body, first.body)
  const other = await pay('same', { ...BODY, amount: 101 })
  t.equal(other.statusCode, 422)
  t.equal(runs(), 1)
})

t.test('without encryption nothing changes: canonical-v1, byte for byte the digest existing records hold', async (t) => {
  const store = memory(t)
  const { pay } = await world(t, store)
  await pay('plain')
  const stored = await storedFingerprint(store, 'plain')
  t.equal(stored.algorithm, 'canonical-v1')
  t.equal(stored.digest.toString('hex'), sha256(CANONICAL_INPUT).toString('hex'))
})

t.test('key rotation: a completed record made under k1 is replayed by a server whose ring is [k2, k1]; new records use k2', async (t) => {
  const store = memory(t)
  const before = await world(t, store, { encryption: ring('k1') })
  const original = await before.pay('rotated')
  t.equal(original.statusCode, 201)

  const after = await world(t, store, { encryption: ring('k2', 'k1') })
  const retry = await after.pay('rotated')
  t.equal(retry.statusCode, 201, `a genuine retry is not a 422: ${retry.body}`)
  t.equal(retry.headers['idempotent-replayed'], 'true')
  t.equal(retry.body, original.body)
  t.equal(after.runs(), 0, 'not executed again')
  t.equal((await after.pay('rotated', { ...BODY, amount: 5 })).statusCode, 422, 'another request under the old key is still 422')

  await after.pay('fresh')
  t.equal((await storedFingerprint(store, 'fresh')).algorithm, 'hmac-canonical-v1.k2', 'the first key makes new fingerprints')
})

t.test('key rotation: an in-progress record under k1 is 409 while its owner lives, and taken over once its lease lapsed', async (t) => {
  const clock = manualClock(Date.now())
  const store = memory(t, clock.now)
  // Owners under k1 that crashed (or still run): claims no plugin instance of this test renews.
  const live = await store.claim({ scope: 'test', key: 'live', fingerprint: keyedCanonical('k1'), leaseMs: 60_000, ttlMs: 3_600_000 })
  const crashed = await store.claim({ scope: 'test', key: 'crashed', fingerprint: keyedCanonical('k1'), leaseMs: 1_000, ttlMs: 3_600_000 })
  t.equal(live.outcome, 'acquired')
  t.equal(crashed.outcome, 'acquired')
  clock.advance(2_000)

  const { pay, runs } = await world(t, store, { encryption: ring('k2', 'k1') })
  const inFlight = await pay('live')
  t.equal(inFlight.statusCode, 409, `the same request, still running: ${inFlight.body}`)
  t.equal(runs(), 0)

  const takeover = await pay('crashed')
  t.equal(takeover.statusCode, 201, `the retry takes the lapsed key over: ${takeover.body}`)
  t.equal(runs(), 1)
  const record = await store.get({ scope: 'test', key: 'crashed' })
  t.equal(record?.state, 'completed')
  t.equal(record?.fingerprint.algorithm, 'hmac-canonical-v1.k1', 'the record keeps the fingerprint it was made with')
  const replay = await pay('crashed')
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal((await pay('crashed', { ...BODY, amount: 1 })).statusCode, 422)
  t.equal(runs(), 1)
})

t.test('records made before encryption was enabled (unkeyed) are still recognised: replayed, taken over, told apart', async (t) => {
  const clock = manualClock(Date.now())
  const store = memory(t, clock.now)
  const plain = await world(t, store)
  const original = await plain.pay('legacy-done')
  t.equal((await storedFingerprint(store, 'legacy-done')).algorithm, 'canonical-v1')
  await store.claim({ scope: 'test', key: 'legacy-crashed', fingerprint: { algorithm: 'canonical-v1', digest: sha256(CANONICAL_INPUT) }, leaseMs: 1_000, ttlMs: 3_600_000 })
  clock.advance(2_000)

  const { pay, runs } = await world(t, store, { encryption: migrating(ring('k1')) })
  const replay = await pay('legacy-done')
  t.equal(replay.headers['idempotent-replayed'], 'true', 'the migration path: a record from before encryption replays')
  t.equal(replay.body, original.body)
  t.equal((await pay('legacy-done', { ...BODY, amount: 3 })).statusCode, 422)
  t.equal((await pay('legacy-crashed')).statusCode, 201, 'a lapsed one is taken over')
  t.equal(runs(), 1)
  t.equal((await pay('legacy-crashed')).headers['idempotent-replayed'], 'true')
  t.equal(runs(), 1)
})

t.test('a record keyed by a key no longer in the ring cannot be checked: 503, never a 422 and never a second execution', async (t) => {
  const clock = manualClock(Date.now())
  const store = memory(t, clock.now)
  await store.claim({ scope: 'test', key: 'removed-key', fingerprint: keyedCanonical('k0'), leaseMs: 1_000, ttlMs: 3_600_000 })
  clock.advance(2_000)
  for (const options of [{ encryption: ring('k2', 'k1') }, {}, { encryption: ring('k1'), onStoreError: 'bypass' as const }]) {
    const { pay, runs } = await world(t, store, options)
    const res = await pay('removed-key')
    t.equal(res.statusCode, 503, `${JSON.stringify(Object.keys(options))}: ${res.body}`)
    t.equal((JSON.parse(res.body) as { type: string }).type, PROBLEM_TYPE('store-unavailable'))
    t.equal(runs(), 0, 'not executed')
  }
})

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL must be set: run `node scripts/test.mjs test/fingerprint/keyed.test.ts` (it starts a throwaway PostgreSQL server).')
} else {
  postgresSuite(DATABASE_URL)
}

function postgresSuite (url: string): void {
  const { name: schema, sql } = postgresSchema(t, url, { prefix: 'idem_fp', client: { max: 4 } })
  let tables = 0
  async function table (): Promise<{ store: IdempotencyStore, row: (key: string) => Promise<{ algorithm: string, fingerprint: Buffer } | undefined> }> {
    const name = `records_${++tables}`
    const store = postgresStore({ sql, schema, table: name, purgeInterval: 0 })
    await store.migrate()
    const row = async (key: string): Promise<{ algorithm: string, fingerprint: Buffer } | undefined> => {
      const [found] = await sql<Array<{ algorithm: string, fingerprint: Buffer }>>`
        SELECT fingerprint_algorithm AS algorithm, fingerprint FROM ${sql(schema)}.${sql(name)} WHERE scope = 'test' AND key = ${key}`
      return found
    }
    return { store, row }
  }

  for (const mode of ['lease', 'atomic'] as const) {
    const options: IdempotencyOptions = mode === 'atomic' ? { transaction: true } : {}

    t.test(`postgres (${mode} mode): the fingerprint in the row is the HMAC, not the unkeyed hash`, async (t) => {
      const { store, row } = await table()
      const { pay } = await world(t, store, { ...options, encryption: ring('k1') })
      t.equal((await pay('pg-card')).statusCode, 201)
      const stored = await row('pg-card')
      t.equal(stored?.algorithm, 'hmac-canonical-v1.k1')
      t.notOk(stored?.fingerprint.equals(sha256(CANONICAL_INPUT)), 'not the guessable hash')
      t.ok(stored?.fingerprint.equals(keyedCanonical('k1').digest), 'the HMAC')
    })

    t.test(`postgres (${mode} mode): across a rotation, a completed record replays and a lapsed one is taken over by the takeover statement`, async (t) => {
      const { store, row } = await table()
      const before = await world(t, store, { ...options, encryption: ring('k1') })
      const original = await before.pay('pg-done')
      // A crashed owner under k1, its lease already over (leases are timed by the database's clock).
      const crashed = await store.claim({ scope: 'test', key: 'pg-crashed', fingerprint: keyedCanonical('k1'), leaseMs: 1, ttlMs: 3_600_000 })
      t.equal(crashed.outcome, 'acquired')
      await sleep(20)

      const after = await world(t, store, { ...options, encryption: ring('k2', 'k1') })
      const retry = await after.pay('pg-done')
      t.equal(retry.statusCode, 201)
      t.equal(retry.headers['idempotent-replayed'], 'true')
      t.equal(retry.body, original.body)
      const takeover = await after.pay('pg-crashed')
      t.equal(takeover.statusCode, 201, `taken over, not 422 or 409: ${takeover.body}`)
      t.equal(after.runs(), 1)
      t.equal((await row('pg-crashed'))?.algorithm, 'hmac-canonical-v1.k1')
      t.equal((await after.pay('pg-crashed')).headers['idempotent-replayed'], 'true')
      t.equal((await after.pay('pg-crashed', { ...BODY, amount: 2 })).statusCode, 422)
      t.equal(after.runs(), 1)
    })
  }
}
