import { randomBytes } from 'node:crypto'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import { Redis } from 'ioredis'
import t, { type Test } from 'tap'
import idempotency, { InvalidOptionError, memoryStore, type EncryptionOptions, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import { encryptedPrefilter, encryptedStore, openResponse, SEALED_HEADER, sealResponse, SealedResponseError } from '../../lib/core/encryption.js'
import { resolveKeyring } from '../../lib/core/keyring.js'
import type { IdempotencyPrefilter } from '../../lib/core/prefilter.js'
import type { Lease, StoredResponse } from '../../lib/core/store.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { redisPrefilter } from '../../drivers/redis/index.js'
import { FIELD, recordKey } from '../../drivers/redis/keys.js'
import { PROBLEM_TYPE } from '../helpers/app.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Encryption at rest of recorded responses (`encryption` option): replays stay byte-identical,
 * what the memory store, PostgreSQL (lease and atomic mode) and the Redis pre-filter hold contains
 * no plaintext, keys rotate by id, and a record that does not open is a 503, never a re-execution.
 */

const K1 = randomBytes(32)
const K2 = randomBytes(32)
const ring = (...ids: Array<'k1' | 'k2'>): EncryptionOptions => ({ keys: ids.map((id) => ({ id, key: id === 'k1' ? K1 : K2 })) })

// Distinctive strings the handler answers with: none may appear in what is stored.
const BODY_SECRET = `pan-4242-${randomBytes(8).toString('hex')}`
const LOCATION_SECRET = `acct-${randomBytes(8).toString('hex')}`
const ETAG_SECRET = `etag-${randomBytes(8).toString('hex')}`

const headersFor = (key: string, tenant: string): Record<string, string> =>
  ({ 'idempotency-key': `"${key}"`, 'content-type': 'application/json', 'x-tenant': tenant })

interface World {
  readonly app: FastifyInstance
  /** Handler executions per key, across every app of the test sharing this map. */
  readonly runs: Map<string, number>
  readonly pay: (key: string, options?: { tenant?: string, amount?: number }) => Promise<LightMyRequestResponse>
}

/** An app on `store` whose POST /pay answers with the secrets above and a fresh random charge. */
async function world (t: Test, store: IdempotencyStore, options: IdempotencyOptions = {}, runs = new Map<string, number>()): Promise<World> {
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: (request) => String(request.headers['x-tenant']), ...options })
  app.post('/pay', async (request, reply) => {
    const key = request.idempotency?.key ?? ''
    runs.set(key, (runs.get(key) ?? 0) + 1)
    // Atomic mode: the handler's work goes through the claim's transaction.
    const tx = request.idempotency?.sql
    if (tx !== undefined) await tx`SELECT 1`
    return reply.code(201)
      .header('location', `/payments/${LOCATION_SECRET}`)
      .header('etag', `"${ETAG_SECRET}"`)
      .send({ card: BODY_SECRET, charge: randomBytes(8).toString('hex') })
  })
  await app.ready()
  const pay = (key: string, { tenant = 'tenant-a', amount = 100 }: { tenant?: string, amount?: number } = {}): Promise<LightMyRequestResponse> =>
    app.inject({ method: 'POST', url: '/pay', headers: headersFor(key, tenant), payload: { amount } })
  return { app, runs, pay }
}

function sameAnswer (t: Test, replay: LightMyRequestResponse, original: LightMyRequestResponse): void {
  t.equal(replay.statusCode, original.statusCode, 'same status')
  t.ok(replay.rawPayload.equals(original.rawPayload), 'byte-identical body')
  for (const name of ['content-type', 'location', 'etag']) t.equal(replay.headers[name], original.headers[name], `same ${name}`)
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal(original.headers['idempotent-replayed'], undefined)
}

function storeUnavailable (t: Test, answer: LightMyRequestResponse): void {
  t.equal(answer.statusCode, 503)
  t.match(answer.headers['content-type'], /^application\/problem\+json\b/)
  t.equal(answer.headers['retry-after'], '1')
  t.equal((answer.json() as { type: string }).type, PROBLEM_TYPE('store-unavailable'))
  t.notOk(answer.body.includes(BODY_SECRET), 'nothing recorded leaks into the problem')
}

/** What a backend holds for a record, as an operator (or a database dump) sees it. */
interface RawRecord { readonly status: number | null, readonly headers: string, readonly body: Buffer | null }

function inClear (raw: RawRecord): string[] {
  const text = `${raw.headers}\n${raw.body?.toString('latin1') ?? ''}`
  return [BODY_SECRET, LOCATION_SECRET, ETAG_SECRET, 'application/json'].filter((secret) => text.includes(secret))
}

const markerOf = (raw: RawRecord | null): string | undefined =>
  raw === null ? undefined : (JSON.parse(raw.headers) as Record<string, string>)[SEALED_HEADER]

// ---------------------------------------------------------------------------------------------
// The option
// ---------------------------------------------------------------------------------------------

async function registrationError (options: IdempotencyOptions): Promise<unknown> {
  const app = Fastify()
  try {
    await app.register(idempotency, { store: memoryStore({ purgeInterval: 0 }), ...options })
    await app.ready()
    return null
  } catch (err) {
    return err
  } finally {
    await app.close()
  }
}

t.test('the option is validated at registration, naming the option and never showing key material', async (t) => {
  const short = randomBytes(16)
  const hex = K1.toString('hex')
  const cases: Array<[unknown, RegExp]> = [
    ['secret', /option "encryption" must be \{ keys: \[\{ id, key \}, \.\.\.\] \}; received a string of 6 characters$/],
    [K1, /option "encryption" must be .*; received a Buffer of 32 bytes$/],
    [{ keys: [] }, /option "encryption"\.keys must be a non-empty array .*; received an array of 0 items$/],
    [{ keys: K1 }, /option "encryption"\.keys must be .*; received a Buffer of 32 bytes$/],
    [{ keys: [{ id: 'k1', key: K1 }], rotate: true }, /option "encryption" must be an object with the properties keys, acceptUnsealed, acceptV1; received an object with properties keys, rotate$/],
    [{ keys: [null] }, /option "encryption"\.keys\[0\] must be an object \{ id, key \}; received null$/],
    [{ keys: [{ id: 'k1', key: K1, secret: K2 }] }, /option "encryption"\.keys\[0\] must be an object with only "id" and "key"; received an object with properties id, key, secret$/],
    [{ keys: [{ id: 'k1', key: short }] }, /option "encryption"\.keys\[0\]\.key must be a Buffer \(or Uint8Array\) of exactly 32 bytes \(AES-256\); received a Buffer of 16 bytes$/],
    [{ keys: [{ id: 'k1', key: hex }] }, /keys\[0\]\.key must be .*; received a string of 64 characters$/],
    [{ keys: [{ id: 'k1', key: K1 }, { id: 'k2', key: Buffer.alloc(32) }] }, /keys\[1\]\.key must be 32 random bytes, not all zero; received a Buffer of 32 bytes$/],
    [{ keys: [{ id: '', key: K1 }] }, /keys\[0\]\.id must be 1 to 32 characters among A-Z a-z 0-9 _ -; received a string of 0 characters$/],
    [{ keys: [{ id: 'v1.k1', key: K1 }] }, /keys\[0\]\.id must be 1 to 32 characters/],
    [{ keys: [{ id: 'k'.repeat(33), key: K1 }] }, /keys\[0\]\.id must be 1 to 32 characters/],
    [{ keys: [{ id: 7, key: K1 }] }, /keys\[0\]\.id must be .*; received 7$/],
    [{ keys: [{ id: hex, key: K1 }] }, /keys\[0\]\.id must be .*; received a string of 64 characters$/],
    [{ keys: [{ id: 'k1', key: K1 }, { id: 'k1', key: K2 }] }, /keys\[1\]\.id must be unique among the keys; received 'k1'/]
  ]
  for (const [encryption, message] of cases) {
    const err = await registrationError({ encryption: encryption as EncryptionOptions })
    t.type(err, InvalidOptionError, message.source)
    const { message: text, received } = err as InvalidOptionError
    t.match(text, message)
    for (const material of [K1, K2, short]) {
      for (const encoding of ['hex', 'base64', 'latin1'] as const) {
        t.notOk(text.includes(material.toString(encoding)), `no key material in the message (${encoding})`)
      }
      t.not(received, material, 'nor in the error\'s `received`')
    }
    t.notOk(/<Buffer|Uint8Array\(/.test(text), 'no inspected bytes')
  }

  const routeErr = await (async () => {
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store: memoryStore({ purgeInterval: 0 }) })
    try {
      app.post('/x', { config: { idempotency: { encryption: ring('k1') } as never } }, async () => 'x')
    } catch (err) {
      return err
    }
    return null
  })()
  t.match((routeErr as Error).message, /route POST \/x config\.idempotency\.encryption must be one of/, 'registration only: refused per route')

  const marker = await registrationError({ replayHeaders: ['content-type', SEALED_HEADER] })
  t.type(marker, InvalidOptionError, 'the marker field can never be recorded from a handler: it is not a header name')

  t.equal(await registrationError({ encryption: { keys: [{ id: 'k_1-A', key: new Uint8Array(K1) }] } }), null, 'a Uint8Array key is accepted')
})

t.test('the keys are copied at registration: zeroing the caller\'s Buffer afterwards changes nothing', async (t) => {
  const key = Buffer.from(K1)
  const { runs, pay } = await world(t, memoryStore({ purgeInterval: 0 }), { encryption: { keys: [{ id: 'k1', key }] } })
  const first = await pay('copy')
  key.fill(0)
  sameAnswer(t, await pay('copy'), first)
  t.equal(runs.get('copy'), 1)
})

// ---------------------------------------------------------------------------------------------
// The sealed format
// ---------------------------------------------------------------------------------------------

t.test('sealResponse / openResponse', async (t) => {
  const keyring = resolveKeyring(ring('k2', 'k1'))
  const id = { scope: 'tenant-a', key: 'key-1' }
  const fp = { algorithm: 'canonical-v1', digest: Buffer.alloc(32, 1) }
  const body = Buffer.from(Array.from({ length: 256 }, (_, i) => i))
  const response: StoredResponse = {
    statusCode: 201,
    headers: { 'content-type': 'application/octet-stream', link: ['<a>; rel=next', `<${LOCATION_SECRET}>; rel=self`] },
    body
  }

  const sealed = sealResponse(keyring, id, fp, response)
  t.equal(sealed.statusCode, 201, 'the status stays in clear')
  t.same(sealed.headers, { [SEALED_HEADER]: 'v2.k2' }, 'headers hold the marker only: format and key id of the FIRST key')
  const json = JSON.stringify(response.headers)
  t.equal(sealed.body?.length, 12 + 16 + 4 + Buffer.byteLength(json) + body.length, 'iv | tag | ciphertext of length-prefixed headers and body')
  t.notOk(sealed.body?.includes(body.subarray(32, 64)), 'no run of the body in clear')
  t.notOk(sealed.body?.toString('latin1').includes(LOCATION_SECRET), 'no header value in clear')
  t.same(openResponse(keyring, id, fp, sealed), response, 'opens to the same status, headers and bytes')
  t.not(sealResponse(keyring, id, fp, response).body?.toString('hex'), sealed.body?.toString('hex'), 'a fresh IV per seal: the same response seals differently')
  t.same(openResponse(resolveKeyring(ring('k1', 'k2')), id, fp, sealed), response, 'any key of the ring opens, whatever its position')

  const refused = (what: string, tampered: StoredResponse, pattern: RegExp, where = id, ring2 = keyring, fingerprint = fp): void => {
    t.throws(() => openResponse(ring2, where, fingerprint, tampered), SealedResponseError, what)
    t.throws(() => openResponse(ring2, where, fingerprint, tampered), pattern, what)
  }
  const sealedBody = sealed.body as Buffer
  const flipped = (offset: number): StoredResponse => {
    const copy = Buffer.from(sealedBody)
    copy[offset] = (copy[offset] as number) ^ 1
    return { ...sealed, body: copy }
  }
  refused('a flipped IV bit', flipped(0), /fails authentication under key id "k2"/)
  refused('a flipped tag bit', flipped(20), /fails authentication/)
  refused('a flipped ciphertext bit', flipped(sealedBody.length - 1), /fails authentication/)
  refused('another key', sealed, /fails authentication/, { scope: 'tenant-a', key: 'key-2' })
  refused('another scope', sealed, /fails authentication/, { scope: 'tenant-b', key: 'key-1' })
  refused('the boundary between scope and key moved', sealResponse(keyring, { scope: 'ab', key: 'c' }, fp, response), /fails authentication/, { scope: 'a', key: 'bc' })
  refused('another status', { ...sealed, statusCode: 200 }, /fails authentication/)
  refused('another request (fingerprint digest)', sealed, /fails authentication/, id, keyring, { ...fp, digest: Buffer.alloc(32, 2) })
  refused('another fingerprint algorithm', sealed, /fails authentication/, id, keyring, { ...fp, algorithm: 'raw-v1' })
  refused('relabelled with the other key\'s id', { ...sealed, headers: { [SEALED_HEADER]: 'v2.k1' } }, /fails authentication under key id "k1"/)
  refused('relabelled as v1 (accepted for migration)', { ...sealed, headers: { [SEALED_HEADER]: 'v1.k2' } }, /fails authentication/, id, resolveKeyring({ ...ring('k2'), acceptV1: true }))
  refused('relabelled as v1 (refused)', { ...sealed, headers: { [SEALED_HEADER]: 'v1.k2' } }, /sealed in format v1, whose seal does not cover the request fingerprint/)
  refused('a key id not in the ring', sealed, /sealed with key id "k2", which is not in the encryption keys/, id, resolveKeyring(ring('k1')))
  refused('an unknown format', { ...sealed, headers: { [SEALED_HEADER]: 'v9.k2' } }, /format "v9" is not v2/)
  refused('an unauthenticated field next to the marker', { ...sealed, headers: { ...sealed.headers, location: '/elsewhere' } }, /marker is malformed/)
  refused('truncated', { ...sealed, body: sealedBody.subarray(0, 20) }, /truncated/)
  refused('the body dropped (made "not retained")', { ...sealed, body: null }, /marker is malformed/)
  t.throws(() => sealResponse(keyring, id, fp, { ...response, headers: { [SEALED_HEADER]: 'v2.k2' } }), /reserved field/, 'a response carrying the marker is never sealed')

  const plaintext: StoredResponse = { statusCode: 200, headers: { 'content-type': 'text/plain' }, body: Buffer.from('recorded before encryption') }
  refused('a record without the marker (in clear)', plaintext, /stored in clear while encryption is on/)
  t.equal(openResponse(resolveKeyring({ ...ring('k2'), acceptUnsealed: true }), id, fp, plaintext), plaintext,
    'with acceptUnsealed, a record without the marker (written before encryption) is returned as it is')

  const notRetained: StoredResponse = { statusCode: 202, headers: { location: `/jobs/${LOCATION_SECRET}` }, body: null }
  const sealedNull = sealResponse(keyring, id, fp, notRetained)
  t.equal(sealedNull.body, null, 'a body that was not retained stays null')
  const marker = sealedNull.headers[SEALED_HEADER] as string
  t.match(marker, /^v2\.k2\.[A-Za-z0-9_-]+$/, 'its sealed headers travel in the marker')
  t.notOk(marker.includes(LOCATION_SECRET))
  t.same(openResponse(keyring, id, fp, sealedNull), notRetained)
  refused('a not-retained record of another request', sealedNull, /fails authentication/, id, keyring, { ...fp, digest: Buffer.alloc(32, 3) })
  refused('a not-retained record given a body', { ...sealedNull, body: Buffer.alloc(40) }, /marker is malformed/)
  refused('a not-retained record under another key', sealedNull, /fails authentication/, { scope: 'tenant-a', key: 'other' })
})

// ---------------------------------------------------------------------------------------------
// The decorators forward what they do not wrap
// ---------------------------------------------------------------------------------------------

t.test('the store and pre-filter decorators forward every member they do not wrap, present or added later', async (t) => {
  const keyring = resolveKeyring(ring('k1'))
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  const holds: string[] = []
  // A driver with its own members: a method using `this`, a getter, a plain value; frozen, so a
  // Proxy over it directly would break its invariants.
  const store = Object.freeze({
    ...inner,
    label: 'pg-like',
    get openTransactions () { return holds.length },
    async hold (this: { label: string }, lease: Lease): Promise<boolean> { holds.push(`${this.label}:${lease.key}`); return true }
  })
  const wrapped = encryptedStore(keyring, store) as typeof store

  const claimed = await wrapped.claim({ scope: 's', key: 'k', fingerprint: { algorithm: 'raw-v1', digest: Buffer.alloc(32) }, leaseMs: 1000, ttlMs: 10_000 })
  if (claimed.outcome !== 'acquired') throw new Error('expected to acquire')
  t.equal(await wrapped.hold(claimed.lease), true, 'an extra method works through the wrapper')
  t.same(holds, ['pg-like:k'], '…called on the store itself (`this` is the driver)')
  t.equal(wrapped.openTransactions, 1, 'a getter reads the live value')
  t.equal(wrapped.label, 'pg-like')
  t.ok('hold' in wrapped, '`in` sees it')
  t.same(Object.keys({ ...wrapped }).sort(), Object.keys(store).sort(), 'spreading the wrapper copies every member')
  t.equal(wrapped.claimInTransaction, undefined, 'an optional method the store lacks stays absent (atomic mode is still refused)')
  t.equal('claimInTransaction' in wrapped, false)

  const response: StoredResponse = { statusCode: 201, headers: { etag: `"${ETAG_SECRET}"` }, body: Buffer.from(BODY_SECRET) }
  t.equal(await wrapped.complete(claimed.lease, response, 10_000), true, 'complete is wrapped…')
  const raw = await inner.get({ scope: 's', key: 'k' })
  t.equal(raw?.state === 'completed' && raw.response.headers[SEALED_HEADER], 'v2.k1', '…and seals')
  t.same(await wrapped.get({ scope: 's', key: 'k' }), { state: 'completed', fingerprint: raw?.fingerprint, response }, 'get opens')

  const extensible = { ...inner } as IdempotencyStore & { later?: () => string }
  const late = encryptedStore(keyring, extensible) as typeof extensible
  extensible.later = function (this: unknown) { return this === extensible ? 'bound to the store' : 'unbound' }
  t.equal(late.later?.(), 'bound to the store', 'a method the store gains after wrapping is reached too')

  let remembered: StoredResponse | null = null
  const prefilter: IdempotencyPrefilter & { readonly stats: { hits: number } } = {
    stats: { hits: 3 },
    lookup: async () => remembered === null ? null : { state: 'completed', fingerprint: { algorithm: 'raw-v1', digest: Buffer.alloc(32) }, response: remembered },
    markInFlight: async () => {},
    clearInFlight: async () => {},
    remember: async (_id, _fp, sealed) => { remembered = sealed },
    close: async () => {}
  }
  const wrappedPrefilter = encryptedPrefilter(keyring, prefilter) as typeof prefilter
  t.same(wrappedPrefilter.stats, { hits: 3 }, 'pre-filter members are forwarded')
  await wrappedPrefilter.remember({ scope: 's', key: 'k' }, { algorithm: 'raw-v1', digest: Buffer.alloc(32) }, response, 1000)
  t.equal((remembered as StoredResponse | null)?.headers[SEALED_HEADER], 'v2.k1', 'remember seals')
  const hit = await wrappedPrefilter.lookup({ scope: 's', key: 'k' })
  t.same(hit?.state === 'completed' && hit.response, response, 'lookup opens')
  await t.rejects(wrappedPrefilter.lookup({ scope: 's', key: 'other' }), SealedResponseError, 'a copy that does not open rejects (read as a miss)')
})

// ---------------------------------------------------------------------------------------------
// Through the plugin, on every backend
// ---------------------------------------------------------------------------------------------

interface Backend {
  readonly name: string
  /** A fresh, empty store (its raw reader sees what is at rest) and the options the mode needs. */
  readonly make: (t: Test) => Promise<{ store: IdempotencyStore, raw: (scope: string, key: string) => Promise<RawRecord | null>, options: IdempotencyOptions }>
}

function behaviours (backend: Backend): void {
  t.test(`${backend.name}: a replay is byte-identical and nothing is stored in clear`, async (t) => {
    const { store, raw, options } = await backend.make(t)
    const { runs, pay } = await world(t, store, { ...options, encryption: ring('k1') })
    const first = await pay('plain-check')
    t.equal(first.statusCode, 201)
    t.ok(first.body.includes(BODY_SECRET), 'the client sees the real body')
    sameAnswer(t, await pay('plain-check'), first)
    t.equal(runs.get('plain-check'), 1, 'the handler ran once')
    const stored = await raw('tenant-a', 'plain-check')
    t.equal(stored?.status, 201, 'the status is at rest in clear')
    t.equal(markerOf(stored), 'v2.k1')
    t.same(stored === null ? ['no record'] : inClear(stored), [], 'no body or header value in clear at rest')
  })

  t.test(`${backend.name}: rotation, a record sealed under k1 replays under [k2, k1]; with [k2] only, it is a 503, not a re-execution`, async (t) => {
    const { store, raw, options } = await backend.make(t)
    const runs = new Map<string, number>()
    const before = await world(t, store, { ...options, encryption: ring('k1') }, runs)
    const old = await before.pay('old')
    await before.app.close()

    const rotated = await world(t, store, { ...options, encryption: ring('k2', 'k1') }, runs)
    sameAnswer(t, await rotated.pay('old'), old)
    const fresh = await rotated.pay('new')
    t.equal(markerOf(await raw('tenant-a', 'new')), 'v2.k2', 'new records are sealed with the first key')
    t.equal(markerOf(await raw('tenant-a', 'old')), 'v2.k1', 'the old record is left as it was')
    await rotated.app.close()

    const retired = await world(t, store, { ...options, encryption: ring('k2') }, runs)
    storeUnavailable(t, await retired.pay('old'))
    t.equal(runs.get('old'), 1, 'a record whose key was dropped is never executed again')
    await retired.app.close()
    // onStoreError 'bypass' runs the handler when the store is DOWN; a record that does not open is
    // an answer from a working store (the operation ran), so it is still a 503.
    const bypassing = await world(t, store, { ...options, encryption: ring('k2'), onStoreError: 'bypass' }, runs)
    storeUnavailable(t, await bypassing.pay('old'))
    t.equal(runs.get('old'), 1, 'not even with onStoreError: bypass')
    sameAnswer(t, await bypassing.pay('new'), fresh)
    t.equal(runs.get('new'), 1)
  })

  t.test(`${backend.name}: a record written before encryption was enabled replays with acceptUnsealed, and is a 503 without it`, async (t) => {
    const { store, raw, options } = await backend.make(t)
    const runs = new Map<string, number>()
    const clear = await world(t, store, options, runs)
    const original = await clear.pay('legacy')
    await clear.app.close()
    t.equal(markerOf(await raw('tenant-a', 'legacy')), undefined, 'written in clear')

    const strict = await world(t, store, { ...options, encryption: ring('k1') }, runs)
    storeUnavailable(t, await strict.pay('legacy'))
    t.equal(runs.get('legacy'), 1, 'refused by default, and never executed again')
    await strict.app.close()

    const encrypted = await world(t, store, { ...options, encryption: { ...ring('k1'), acceptUnsealed: true } }, runs)
    sameAnswer(t, await encrypted.pay('legacy'), original)
    t.equal(runs.get('legacy'), 1)
    t.equal((await encrypted.pay('legacy', { amount: 5 })).statusCode, 422, 'and still tells a different request apart')
  })

  t.test(`${backend.name}: with encryption turned off, a sealed record is neither replayed as ciphertext nor executed again`, async (t) => {
    const { store, raw, options } = await backend.make(t)
    const runs = new Map<string, number>()
    const encrypted = await world(t, store, { ...options, encryption: ring('k1') }, runs)
    await encrypted.pay('sealed')
    await encrypted.app.close()
    const sealed = (await raw('tenant-a', 'sealed'))?.body as Buffer

    const plain = await world(t, store, options, runs)
    const retry = await plain.pay('sealed')
    t.ok(retry.statusCode >= 500, `an error answer (${retry.statusCode}), not the record`)
    t.notOk(retry.rawPayload.includes(sealed.subarray(28)), 'no ciphertext sent')
    t.notOk(retry.body.includes(BODY_SECRET))
    t.equal(runs.get('sealed'), 1, 'the handler did not run again')
  })

  t.test(`${backend.name}: a response that was not retained keeps a null body; its headers are sealed; retries get 410`, async (t) => {
    const { store, raw, options } = await backend.make(t)
    const { runs, pay } = await world(t, store, { ...options, encryption: ring('k1'), maxResponseBytes: 8 })
    const first = await pay('big')
    t.ok(first.body.includes(BODY_SECRET), 'the first client gets the whole body')
    const stored = await raw('tenant-a', 'big')
    t.equal(stored?.body, null, 'the body is not retained')
    t.match(markerOf(stored), /^v2\.k1\./)
    t.same(stored === null ? ['no record'] : inClear(stored), [], 'the headers are not in clear')
    const retry = await pay('big')
    t.equal(retry.statusCode, 410)
    t.equal((retry.json() as { originalStatus: number }).originalStatus, 201, 'the plain status code still reports the outcome')
    t.equal(runs.get('big'), 1)
  })
}

behaviours({
  name: 'memory store',
  make: async (t) => {
    const store = memoryStore({ purgeInterval: 0 })
    t.teardown(() => store.close())
    return {
      store,
      options: {},
      raw: async (scope, key) => {
        const record = await store.get({ scope, key })
        return record?.state === 'completed'
          ? { status: record.response.statusCode, headers: JSON.stringify(record.response.headers), body: record.response.body }
          : null
      }
    }
  }
})

const DATABASE_URL = process.env.DATABASE_URL
const REDIS_URL = process.env.REDIS_URL
if (DATABASE_URL === undefined || DATABASE_URL === '' || REDIS_URL === undefined || REDIS_URL === '') {
  t.fail('DATABASE_URL and REDIS_URL must be set: run `node scripts/test.mjs test/encryption/encryption.test.ts` (it starts throwaway PostgreSQL and Redis servers).')
} else {
  postgresSuite(DATABASE_URL)
  redisSuite(REDIS_URL)
}

function postgresSuite (url: string): void {
  const { name: schema, sql } = postgresSchema(t, url, { prefix: 'idem_enc', client: { max: 6 } })
  let tables = 0

  async function table (): Promise<{ store: PostgresStore, name: string, raw: (scope: string, key: string) => Promise<RawRecord | null> }> {
    const name = `records_${++tables}`
    const store = postgresStore({ sql, schema, table: name, purgeInterval: 0 })
    await store.migrate()
    const raw = async (scope: string, key: string): Promise<RawRecord | null> => {
      const [row] = await sql<Array<{ status: number | null, headers: string, body: Buffer | null }>>`
        SELECT response_status AS status, response_headers::text AS headers, response_body AS body
        FROM ${sql(schema)}.${sql(name)} WHERE scope = ${scope} AND key = ${key} AND state = 'completed'`
      return row ?? null
    }
    return { store, name, raw }
  }

  for (const mode of ['lease', 'atomic'] as const) {
    const options: IdempotencyOptions = mode === 'atomic' ? { transaction: true, wait: 0 } : {}
    behaviours({
      name: `postgres (${mode} mode)`,
      make: async () => {
        const { store, raw } = await table()
        return { store, raw, options }
      }
    })

    t.test(`postgres (${mode} mode): a tampered row, or a row moved to another key or scope, answers 503 and never re-executes`, async (t) => {
      const { store, name } = await table()
      const { runs, pay } = await world(t, store, { ...options, encryption: ring('k1') })
      const records = sql`${sql(schema)}.${sql(name)}`
      for (const key of ['tampered', 'moved', 'rescoped', 'swapped-a', 'swapped-b', 'refingerprinted']) t.equal((await pay(key)).statusCode, 201)
      t.equal((await pay('other-request', { amount: 5 })).statusCode, 201)

      // One bit of the ciphertext, past the IV and the tag.
      await sql`UPDATE ${records} SET response_body = set_byte(response_body, 40, get_byte(response_body, 40) # 1) WHERE key = 'tampered'`
      storeUnavailable(t, await pay('tampered'))
      t.equal(runs.get('tampered'), 1, 'a tampered record is not executed again')

      // The same row under another key (the fingerprint covers the request, not the key, so it matches).
      await sql`UPDATE ${records} SET key = 'moved-elsewhere' WHERE key = 'moved'`
      storeUnavailable(t, await pay('moved-elsewhere'))
      t.equal(runs.get('moved-elsewhere'), undefined, 'the moved record neither replays nor executes')

      await sql`UPDATE ${records} SET scope = 'tenant-b' WHERE key = 'rescoped'`
      storeUnavailable(t, await pay('rescoped', { tenant: 'tenant-b' }))
      t.equal(runs.get('rescoped'), 1, 'another tenant cannot replay a record moved into its scope')

      // A sealed response copied over another record's.
      await sql`UPDATE ${records} AS target SET response_headers = source.response_headers, response_body = source.response_body
        FROM ${records} AS source WHERE target.key = 'swapped-b' AND source.key = 'swapped-a'`
      storeUnavailable(t, await pay('swapped-b'))
      t.equal(runs.get('swapped-b'), 1)

      // The fingerprint of another request (amount 5) copied onto a record: that request must get a
      // 503, not the answer to amount 100.
      await sql`UPDATE ${records} AS target SET fingerprint = source.fingerprint, fingerprint_algorithm = source.fingerprint_algorithm
        FROM ${records} AS source WHERE target.key = 'refingerprinted' AND source.key = 'other-request'`
      storeUnavailable(t, await pay('refingerprinted', { amount: 5 }))
      t.equal(runs.get('refingerprinted'), 1, 'a seal re-attached to another request\'s fingerprint neither replays nor executes')

      if (mode === 'atomic') {
        for (let i = 0; i < 100 && store.openTransactions > 0; i++) await sleep(10)
        t.equal(store.openTransactions, 0, 'a claim whose record does not open leaves no transaction open')
      }
    })
  }
}

function redisSuite (url: string): void {
  t.test('redis pre-filter: the copy in Redis is sealed, replays byte-identical from Redis, and a tampered copy falls through to the store', async (t) => {
    // A database of its own: other test files flush theirs.
    const client = new Redis(url, { db: 5, maxRetriesPerRequest: 1 })
    t.teardown(() => { client.disconnect() })
    const prefix = `enc${randomBytes(4).toString('hex')}`
    const inner = memoryStore({ purgeInterval: 0 })
    t.teardown(() => inner.close())
    let claims = 0
    const store: IdempotencyStore = { ...inner, claim: async (request) => { claims++; return inner.claim(request) } }
    const prefilter = redisPrefilter({ client, prefix, timeout: 500 })
    const { runs, pay } = await world(t, store, { prefilter, encryption: ring('k1') })
    const hash = recordKey(prefix, { scope: 'tenant-a', key: 'cached' })

    const first = await pay('cached')
    let copy: Record<string, Buffer> = {}
    for (let i = 0; i < 200 && copy[FIELD.state]?.toString() !== 'completed'; i++) {
      await sleep(10)
      copy = await client.hgetallBuffer(hash)
    }
    t.equal(copy[FIELD.state]?.toString(), 'completed', 'the record was copied into Redis')
    const raw: RawRecord = { status: Number(copy[FIELD.status]?.toString()), headers: copy[FIELD.headers]?.toString() ?? '{}', body: copy[FIELD.body] ?? null }
    t.equal(markerOf(raw), 'v2.k1')
    t.same(inClear(raw), [], 'no body or header value in clear in Redis')

    const claimsBefore = claims
    sameAnswer(t, await pay('cached'), first)
    t.equal(claims, claimsBefore, 'answered from Redis, without the store')

    const tampered = Buffer.from(copy[FIELD.body] as Buffer)
    tampered[tampered.length - 1] = (tampered[tampered.length - 1] as number) ^ 1
    await client.hset(hash, FIELD.body, tampered)
    sameAnswer(t, await pay('cached'), first)
    t.equal(claims, claimsBefore + 1, 'the copy that does not open is a miss: the store answered')
    t.equal(runs.get('cached'), 1, 'never executed again')
  })
}

t.test('the reconciler seals the response it records with the same keys (ReconcileOptions.encryption)', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const runs = new Map<string, number>()
  const app = await world(t, store, { encryption: ring('k1'), fingerprint: () => 'same' }, runs)
  const claim = await store.claim({ scope: 'tenant-a', key: 'stuck', fingerprint: { algorithm: 'custom-v1', digest: (await import('node:crypto')).createHash('sha256').update('same').digest() }, leaseMs: 60_000, ttlMs: 60_000 })
  if (claim.outcome !== 'acquired') throw new Error('claim')
  await store.hold(claim.lease)
  const report = await store.reconcile({
    olderThan: 0,
    encryption: ring('k1'),
    resolve: () => ({ action: 'complete', response: { statusCode: 201, body: { card: BODY_SECRET } } })
  })
  t.equal(report.completed, 1)
  const stored = await store.get({ scope: 'tenant-a', key: 'stuck' })
  const response = stored?.state === 'completed' ? stored.response : null
  t.same(response?.headers, { [SEALED_HEADER]: 'v2.k1' }, 'sealed')
  t.notOk(response?.body?.includes(BODY_SECRET), 'no plaintext at rest')
  const replay = await app.pay('stuck')
  t.same([replay.statusCode, replay.json()], [201, { card: BODY_SECRET }], 'the plugin opens it')
  t.equal(runs.get('stuck'), undefined, 'never executed')
})
