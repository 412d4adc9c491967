import { createHmac, createSecretKey, hkdfSync, type KeyObject } from 'node:crypto'
import type { Keyring } from './keyring.js'
import type { Fingerprint } from './store.js'

/*
 * Keyed fingerprints, when the `encryption` option is set.
 *
 * An unkeyed fingerprint is SHA-256 of a documented, deterministic form of the request, stored in
 * clear: whoever reads the store can confirm guesses about a body (a card number with its BIN and
 * last four known was recovered in under a second). Encryption at rest protects the recorded
 * response, so with encryption on the fingerprint must not give the request away either.
 *
 * hmac-<algorithm>.<key id> = HMAC-SHA-256(F(key), <algorithm>'s SHA-256 digest), where
 * F(key) = HKDF-SHA-256(ikm = the encryption key, salt = empty, info = FINGERPRINT_KEY_INFO, 32 bytes)
 * (RFC 5869; the salt may be empty since the key is already uniformly random, §3.1). The distinct
 * info keeps the MAC key independent of the AES-GCM key that seals responses with the same key.
 *
 * The MAC covers the unkeyed digest rather than the canonical text itself: the text is hashed
 * while it is written (and in raw mode while the body streams in), before the store tells which
 * key the record was made with; with the digest kept for the request, a record made under an older
 * key is re-checked with one HMAC of 32 bytes instead of a second walk or a second read of the
 * body. Distinguishing the two requires a SHA-256 collision, which the unkeyed fingerprint already
 * relies on never happening.
 *
 * The key id in the algorithm name lets records of several keys coexist through a rotation (the
 * first key makes new fingerprints, every key in the ring is still recognised: matchFingerprint).
 */
export const FINGERPRINT_KEY_INFO = 'fastify-idempotency fingerprint v1'
const KEYED_PREFIX = 'hmac-'
const MAC_KEY_BYTES = 32

/** The MAC keys derived from a keyring, by the same key ids; `current` makes new fingerprints. */
export interface FingerprintKeys {
  readonly current: { readonly id: string, readonly key: KeyObject }
  readonly byId: ReadonlyMap<string, KeyObject>
}

/** Derived once, at registration. */
export function deriveFingerprintKeys (keyring: Keyring): FingerprintKeys {
  const byId = new Map<string, KeyObject>()
  for (const [id, key] of keyring.byId) byId.set(id, macKey(key))
  return Object.freeze({
    current: Object.freeze({ id: keyring.current.id, key: byId.get(keyring.current.id) as KeyObject }),
    byId
  })
}

function macKey (encryptionKey: KeyObject): KeyObject {
  return createSecretKey(Buffer.from(hkdfSync('sha256', encryptionKey, Buffer.alloc(0), FINGERPRINT_KEY_INFO, MAC_KEY_BYTES)))
}

/** The fingerprint stored for a request whose unkeyed fingerprint is `unkeyed`. */
export function keyedFingerprint (keys: FingerprintKeys, unkeyed: Fingerprint): Fingerprint {
  const { id, key } = keys.current
  return { algorithm: `${KEYED_PREFIX}${unkeyed.algorithm}.${id}`, digest: mac(key, unkeyed.digest) }
}

function mac (key: KeyObject, digest: Buffer): Buffer {
  return createHmac('sha256', key).update(digest).digest()
}

/** A keyed record under a key id not in the ring: whether it is this request cannot be known. */
export const UNVERIFIABLE = Symbol('fastify-idempotency.unverifiable-fingerprint')

/**
 * The request's fingerprint as `stored` spells it, when the request is the one `stored` was made
 * for, or null when it is another request (422, never a second execution):
 * - the same algorithm: `own`, when the digests are equal;
 * - with `encryption`, a record made before it was enabled (the unkeyed algorithm): `unkeyed`, when
 *   its digest is equal (its response, stored in clear, is still refused unless
 *   `encryption.acceptUnsealed`: lib/core/encryption.ts; an in-progress one is taken over as usual);
 * - a record keyed under an older key still in the ring (a rotation): the request's MAC under it,
 *   when equal.
 * A keyed record whose key is not in the ring (removed too early, or encryption turned off) is
 * UNVERIFIABLE: the record says an operation happened, and calling its retry "another request"
 * would be a guess, so the plugin answers 503 as it does for a sealed response that cannot be opened.
 */
export function matchFingerprint (keys: FingerprintKeys | null, own: Fingerprint, unkeyed: Fingerprint, stored: Fingerprint): Fingerprint | null | typeof UNVERIFIABLE {
  if (own.algorithm === stored.algorithm) return own.digest.equals(stored.digest) ? own : null
  if (stored.algorithm === unkeyed.algorithm) return unkeyed.digest.equals(stored.digest) ? unkeyed : null
  const prefix = `${KEYED_PREFIX}${unkeyed.algorithm}.`
  if (!stored.algorithm.startsWith(prefix)) return null
  const key = keys?.byId.get(stored.algorithm.slice(prefix.length))
  if (key === undefined) return UNVERIFIABLE
  const digest = mac(key, unkeyed.digest)
  return digest.equals(stored.digest) ? { algorithm: stored.algorithm, digest } : null
}
