import { createCipheriv, createDecipheriv, randomBytes } from 'node:crypto'
import type { Keyring } from './keyring.js'
import type { IdempotencyPrefilter, PrefilterHit } from './prefilter.js'
import type { ClaimResult, Fingerprint, IdempotencyStore, Lease, RecordId, StoredRecord, StoredResponse } from './store.js'
import { isThenable } from './thenable.js'

/*
 * Encryption at rest of recorded responses (ietf-wg-httpapi/idempotency#40: a stored response is
 * whatever the API answered, so a database dump or a Redis snapshot must not expose it). Applied
 * at the plugin's boundary: every driver and the pre-filter store sealed records without knowing.
 *
 * A sealed StoredResponse still satisfies the interface:
 * - `statusCode` stays in clear: operators read it, and the 410 "not retained" answer reports it;
 * - `headers` is `{ [SEALED_HEADER]: 'v2.<key id>' }`;
 * - `body` is iv (12) | GCM tag (16) | AES-256-GCM(u32 length of the headers' JSON | that JSON | body).
 * A record whose body was not retained keeps `body: null` (drivers and the 410 path rely on it);
 * its sealed headers then travel in the marker itself: `'v2.<key id>.<base64url(iv | tag | ciphertext)>'`.
 *
 * The additional authenticated data binds the ciphertext to its record (scope, key), the request
 * it answers (the fingerprint's algorithm and digest, format v2), its status code, whether the body
 * was retained, the format and the key id, each length-prefixed so no two tuples encode alike: a
 * sealed response copied onto another key or scope, re-attached to another request's fingerprint
 * (so that request would get it instead of a 422, draft §2.7), or given another status, fails to
 * open instead of replaying someone else's answer.
 *
 * Format v1 (0.1) had the same layout without the fingerprint in its additional data. Such a record,
 * and a record stored in clear, opens only when the keyring accepts it (EncryptionOptions.acceptV1,
 * acceptUnsealed: migration settings, off by default). Anything refused is a SealedResponseError:
 * the plugin answers 503, never a re-execution, since the record says the operation ran.
 */

/**
 * The marker field. Not an RFC 9110 token (`/` is not a tchar), so no real response header has
 * this name: `replayHeaders` refuses it, so a handler can never get it recorded, and a record that
 * carries it was sealed by this module.
 */
export const SEALED_HEADER = 'fastify-idempotency/sealed'
const FORMAT = 'v2'
/** Opened for migration only (Keyring.acceptV1): its seal does not cover the fingerprint. */
const FORMAT_V1 = 'v1'
const CIPHER = 'aes-256-gcm'
/** NIST SP 800-38D §8.2: 96-bit random IVs, fresh for every seal. */
const IV_BYTES = 12
const TAG_BYTES = 16
const AAD_DOMAIN = 'fastify-idempotency sealed response'
const EMPTY = Buffer.alloc(0)

/**
 * A sealed record could not be opened: its key id is not in the keyring, or it fails
 * authentication (tampered bytes, or moved to another record). The plugin answers 503, never
 * a re-execution: the record says the operation happened.
 */
export class SealedResponseError extends Error {
  readonly code = 'FST_IDEMPOTENCY_SEALED_RESPONSE'

  constructor (reason: string) {
    super(`fastify-idempotency: a recorded response cannot be opened: ${reason}`)
    this.name = 'SealedResponseError'
  }
}

/** Encrypts a response's headers and body under the keyring's current key, bound to record `id` and the request's `fingerprint`. */
export function sealResponse (keyring: Keyring, id: RecordId, fingerprint: Fingerprint, response: StoredResponse): StoredResponse {
  if (Object.hasOwn(response.headers, SEALED_HEADER)) {
    throw new TypeError(`fastify-idempotency: a response to record cannot carry the reserved field ${SEALED_HEADER}`)
  }
  const { id: kid, key } = keyring.current
  const retained = response.body !== null
  const headers = Buffer.from(JSON.stringify(response.headers))
  const length = Buffer.allocUnsafe(4)
  length.writeUInt32BE(headers.length)
  const iv = randomBytes(IV_BYTES)
  const cipher = createCipheriv(CIPHER, key, iv, { authTagLength: TAG_BYTES })
  cipher.setAAD(additionalData(FORMAT, kid, id, fingerprint, response.statusCode, retained))
  const encrypted = [cipher.update(length), cipher.update(headers), cipher.update(response.body ?? EMPTY), cipher.final()]
  const sealed = Buffer.concat([iv, cipher.getAuthTag(), ...encrypted])
  return retained
    ? { statusCode: response.statusCode, headers: { [SEALED_HEADER]: `${FORMAT}.${kid}` }, body: sealed }
    : { statusCode: response.statusCode, headers: { [SEALED_HEADER]: `${FORMAT}.${kid}.${sealed.toString('base64url')}` }, body: null }
}

/**
 * The response `sealResponse` sealed for record `id` and the request fingerprint the record holds.
 * Throws SealedResponseError for anything that does not open, and for what the keyring does not
 * accept: a record stored in clear (without the marker: written before encryption was enabled, or
 * planted by someone who can write to the store) unless `acceptUnsealed`, and a v1 record unless
 * `acceptV1`.
 */
export function openResponse (keyring: Keyring, id: RecordId, fingerprint: Fingerprint, response: StoredResponse): StoredResponse {
  const marker = response.headers[SEALED_HEADER]
  if (marker === undefined) {
    if (keyring.acceptUnsealed) return response
    throw new SealedResponseError('it is stored in clear while encryption is on (written before encryption was enabled, or planted in the store); ' +
      'set encryption.acceptUnsealed while records from before encryption still live')
  }
  // Fields next to the marker would be unauthenticated: a sealed record never has any.
  if (typeof marker !== 'string' || Object.keys(response.headers).length !== 1) throw new SealedResponseError('its marker is malformed')
  const [format, kid, detached, ...extra] = marker.split('.')
  if (format === FORMAT_V1 && !keyring.acceptV1) {
    throw new SealedResponseError('it is sealed in format v1, whose seal does not cover the request fingerprint; ' +
      'set encryption.acceptV1 while records sealed before the upgrade still live')
  }
  if (format !== FORMAT && format !== FORMAT_V1) throw new SealedResponseError(`its format "${format ?? ''}" is not ${FORMAT}`)
  const retained = response.body !== null
  if (kid === undefined || extra.length > 0 || (detached === undefined) !== retained) throw new SealedResponseError('its marker is malformed')
  const key = keyring.byId.get(kid)
  if (key === undefined) throw new SealedResponseError(`it was sealed with key id "${kid}", which is not in the encryption keys (was it removed before its records expired?)`)

  const sealed = response.body ?? Buffer.from(detached ?? '', 'base64url')
  if (sealed.length < IV_BYTES + TAG_BYTES + 4) throw new SealedResponseError('it is truncated')
  const decipher = createDecipheriv(CIPHER, key, sealed.subarray(0, IV_BYTES), { authTagLength: TAG_BYTES })
  decipher.setAAD(additionalData(format, kid, id, fingerprint, response.statusCode, retained))
  decipher.setAuthTag(sealed.subarray(IV_BYTES, IV_BYTES + TAG_BYTES))
  let plain: Buffer
  try {
    plain = Buffer.concat([decipher.update(sealed.subarray(IV_BYTES + TAG_BYTES)), decipher.final()])
  } catch {
    throw new SealedResponseError(`it fails authentication under key id "${kid}" (altered, or copied from another record or request)`)
  }
  // Authenticated: these bytes are exactly what sealResponse wrote.
  const headersEnd = 4 + plain.readUInt32BE(0)
  const headers = JSON.parse(plain.subarray(4, headersEnd).toString()) as Record<string, string | string[]>
  return { statusCode: response.statusCode, headers, body: retained ? plain.subarray(headersEnd) : null }
}

/**
 * The store and pre-filter the plugin uses: sealing on the way in, opening on the way out, when
 * `keyring` is set; unchanged otherwise.
 */
export function sealAtRest (keyring: Keyring | null, store: IdempotencyStore, prefilter: IdempotencyPrefilter | null): {
  store: IdempotencyStore
  prefilter: IdempotencyPrefilter | null
} {
  if (keyring === null) return { store, prefilter }
  return { store: encryptedStore(keyring, store), prefilter: prefilter === null ? null : encryptedPrefilter(keyring, prefilter) }
}

/**
 * `store` with `complete` sealing and `claim`, `claimInTransaction` and `get` opening. Every other
 * member (`release`, `renew`, a driver's own extras, optional methods added later) is the store's
 * own, reached through a Proxy, so the decorator never hides a capability the store has.
 *
 * `complete` is given a lease, not the fingerprint its seal must cover: the fingerprint the lease
 * was claimed with is kept for it (weakly: a lease that is never completed is dropped with it).
 */
export function encryptedStore (keyring: Keyring, store: IdempotencyStore): IdempotencyStore {
  const claimedWith = new WeakMap<Lease, Fingerprint>()
  const openClaim = (request: RecordId & { readonly fingerprint: Fingerprint }, result: ClaimResult): ClaimResult => {
    if (result.outcome === 'acquired') claimedWith.set(result.lease, request.fingerprint)
    // The record's own fingerprint: a seal that does not cover it does not open.
    return result.outcome === 'completed' ? { ...result, response: openResponse(keyring, request, result.fingerprint, result.response) } : result
  }
  // claim and complete keep the store's way of answering: a memory store's direct answer stays
  // direct (no promise on its hot path), a promise stays a promise.
  return decorate<IdempotencyStore>(store, {
    claim (request) {
      const result = store.claim(request)
      return isThenable(result) ? Promise.resolve(result).then((value) => openClaim(request, value)) : openClaim(request, result)
    },
    async claimInTransaction (request) {
      // Only reachable when the store has the method: decorate() hides overrides of absent ones.
      return openClaim(request, await (store.claimInTransaction as NonNullable<IdempotencyStore['claimInTransaction']>)(request))
    },
    complete (lease, response, ttlMs) {
      const fingerprint = claimedWith.get(lease)
      if (fingerprint === undefined) throw new TypeError('fastify-idempotency: the encrypting store completes only leases it handed out (its claim binds the seal to the request fingerprint)')
      return store.complete(lease, sealResponse(keyring, lease, fingerprint, response), ttlMs)
    },
    async get (id) {
      const record: StoredRecord | null = await store.get(id)
      return record?.state === 'completed' ? { ...record, response: openResponse(keyring, id, record.fingerprint, record.response) } : record
    }
  })
}

/**
 * `prefilter` with `remember` sealing and `lookup` opening. A copy that does not open makes
 * `lookup` throw, which the plugin treats as a miss: the store answers.
 */
export function encryptedPrefilter (keyring: Keyring, prefilter: IdempotencyPrefilter): IdempotencyPrefilter {
  const openHit = (id: RecordId, hit: PrefilterHit | null): PrefilterHit | null =>
    hit?.state === 'completed' ? { ...hit, response: openResponse(keyring, id, hit.fingerprint, hit.response) } : hit
  return decorate<IdempotencyPrefilter>(prefilter, {
    async lookup (id) {
      return openHit(id, await prefilter.lookup(id))
    },
    async lookupOrMark (id, fingerprint, ttlMs) {
      // Only reachable when the pre-filter has the method: decorate() hides overrides of absent ones.
      const looked = await (prefilter.lookupOrMark as NonNullable<IdempotencyPrefilter['lookupOrMark']>)(id, fingerprint, ttlMs)
      return { hit: openHit(id, looked.hit), marked: looked.marked }
    },
    async remember (id, fingerprint, response, ttlMs) {
      return prefilter.remember(id, fingerprint, sealResponse(keyring, id, fingerprint, response), ttlMs)
    }
  })
}

/**
 * A view of `inner` where the methods in `overrides` replace the inner ones (only where `inner`
 * has that method), and everything else, present or added later, is read from `inner`, methods
 * bound to it. The Proxy's own target stays empty, so no Proxy invariant ties it to `inner`'s
 * (possibly frozen) properties.
 */
function decorate<T extends object> (inner: T, overrides: Partial<T>): T {
  const bound = new Map<PropertyKey, { readonly original: unknown, readonly bound: unknown }>()
  const read = (property: PropertyKey): unknown => {
    const value: unknown = Reflect.get(inner, property)
    if (typeof value !== 'function') return value
    if (Object.hasOwn(overrides, property)) return (overrides as Record<PropertyKey, unknown>)[property]
    const cached = bound.get(property)
    if (cached?.original === value) return cached.bound
    const method: unknown = value.bind(inner)
    bound.set(property, { original: value, bound: method })
    return method
  }
  return new Proxy(Object.create(null) as T, {
    get: (_target, property) => read(property),
    has: (_target, property) => Reflect.has(inner, property),
    ownKeys: () => Reflect.ownKeys(inner),
    getOwnPropertyDescriptor: (_target, property) => {
      const own = Reflect.getOwnPropertyDescriptor(inner, property)
      if (own === undefined) return undefined
      return { value: read(property), writable: false, enumerable: own.enumerable ?? false, configurable: true }
    }
  })
}

/**
 * Length-prefixed (u32 BE) fields; scope, key and the fingerprint's algorithm as UTF-16LE, which
 * encodes every JS string injectively. v2 appends the fingerprint; v1 is what 0.1 authenticated.
 */
function additionalData (format: typeof FORMAT | typeof FORMAT_V1, kid: string, id: RecordId, fingerprint: Fingerprint, statusCode: number, retained: boolean): Buffer {
  const fields = [
    Buffer.from(AAD_DOMAIN), Buffer.from(format), Buffer.from(kid),
    Buffer.from(id.scope, 'utf16le'), Buffer.from(id.key, 'utf16le'),
    Buffer.from(String(statusCode)), Buffer.from(retained ? 'retained' : 'not-retained')
  ]
  if (format === FORMAT) fields.push(Buffer.from(fingerprint.algorithm, 'utf16le'), Buffer.from(fingerprint.digest))
  const parts: Buffer[] = []
  for (const field of fields) {
    const length = Buffer.allocUnsafe(4)
    length.writeUInt32BE(field.length)
    parts.push(length, field)
  }
  return Buffer.concat(parts)
}
