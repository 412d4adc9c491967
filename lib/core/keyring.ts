import { createSecretKey, type KeyObject } from 'node:crypto'
import { describeValue } from '../../client/describe-value.js'
import { InvalidOptionError } from './errors.js'

/** One AES-256 key of the `encryption` option. */
export interface EncryptionKey {
  /**
   * Names the key in every record it seals (stored in clear), so a record can be opened after a
   * rotation. 1 to 32 characters among `A-Z a-z 0-9 _ -`; never reuse an id for different key bytes.
   */
  readonly id: string
  /** 32 random bytes, e.g. `crypto.randomBytes(32)`, or `Buffer.from(process.env.KEY, 'base64')`. */
  readonly key: Uint8Array
}

/**
 * Encryption at rest of recorded responses (AES-256-GCM). The FIRST key seals new records; every
 * key opens. To rotate, put the new key first and keep the old ones for one `ttl`, until the
 * records they sealed have expired.
 *
 * @example
 * await app.register(idempotency, {
 *   encryption: { keys: [{ id: '2026-12', key: Buffer.from(process.env.IDEM_KEY_2026_12!, 'base64') }] }
 * })
 */
export interface EncryptionOptions {
  readonly keys: readonly EncryptionKey[]
  /**
   * Replays records stored in clear, as records written before `encryption` was enabled. Off, such
   * a record is refused (503, never a re-execution): with it on, anyone who can write to the store
   * can plant an answer the plugin replays as genuine. A migration setting: on while records from
   * before encryption still live (one `ttl` after enabling it), then off. @defaultValue false
   */
  readonly acceptUnsealed?: boolean
  /**
   * Opens records sealed in format v1 (fastify-idempotency 0.1), whose seal does not cover the
   * request fingerprint: a v1 answer re-attached to another request's fingerprint would still open.
   * Off, such a record is refused (503, never a re-execution). A migration setting: on for one
   * `ttl` after upgrading from 0.1, then off. @defaultValue false
   */
  readonly acceptV1?: boolean
}

/** The validated keys: `current` seals, every key in `byId` (current included) opens. */
export interface Keyring {
  readonly current: { readonly id: string, readonly key: KeyObject }
  readonly byId: ReadonlyMap<string, KeyObject>
  /** Records without the sealed marker are replayed as they are (EncryptionOptions.acceptUnsealed). */
  readonly acceptUnsealed: boolean
  /** Records sealed in format v1 open (EncryptionOptions.acceptV1). */
  readonly acceptV1: boolean
}

export const KEY_BYTES = 32
/** No `.`: the sealed marker uses it as its separator. Bounded: the id is stored with every record. */
const KEY_ID = /^[A-Za-z0-9_-]{1,32}$/
const OPTION = 'option "encryption"'
const PROPERTIES = ['keys', 'acceptUnsealed', 'acceptV1']

/**
 * Validates the `encryption` option once, at registration. Errors never show key material (a key
 * in a log line or a crash report is a leaked key): they describe what was received instead.
 */
export function resolveKeyring (value: unknown): Keyring {
  if (!isPlainObject(value)) throw refuse(OPTION, '{ keys: [{ id, key }, ...] }', value)
  if (Object.keys(value).some((name) => !PROPERTIES.includes(name))) throw refuse(OPTION, `an object with the properties ${PROPERTIES.join(', ')}`, value)
  const acceptUnsealed = flag(`${OPTION}.acceptUnsealed`, value.acceptUnsealed)
  const acceptV1 = flag(`${OPTION}.acceptV1`, value.acceptV1)
  const keys = value.keys
  if (!Array.isArray(keys) || keys.length === 0) {
    throw refuse(`${OPTION}.keys`, 'a non-empty array of { id, key } (the first one encrypts)', keys)
  }

  const byId = new Map<string, KeyObject>()
  let current: Keyring['current'] | null = null
  for (const [index, entry] of keys.entries()) {
    const where = `${OPTION}.keys[${index}]`
    if (!isPlainObject(entry)) throw refuse(where, 'an object { id, key }', entry)
    if (Object.keys(entry).some((name) => name !== 'id' && name !== 'key')) throw refuse(where, 'an object with only "id" and "key"', entry)
    const { id, key } = entry
    if (typeof id !== 'string' || !KEY_ID.test(id)) {
      // Described, not shown: a key pasted into the wrong field must not end up in a log.
      throw refuse(`${where}.id`, '1 to 32 characters among A-Z a-z 0-9 _ -', id)
    }
    // An id is a label stored in clear with every sealed record, and it matched KEY_ID: shown as it is.
    if (byId.has(id)) throw new InvalidOptionError(`${where}.id`, 'unique among the keys', id, `'${id}'`)
    if (!(key instanceof Uint8Array) || key.length !== KEY_BYTES) {
      throw refuse(`${where}.key`, `a Buffer (or Uint8Array) of exactly ${KEY_BYTES} bytes (AES-256)`, key)
    }
    if (key.every((byte) => byte === 0)) {
      // Buffer.alloc(32) passed by mistake: a key everyone knows.
      throw refuse(`${where}.key`, `${KEY_BYTES} random bytes, not all zero`, key)
    }
    // createSecretKey copies the bytes: zeroing or reusing the caller's Buffer later changes nothing.
    const secret = createSecretKey(key)
    byId.set(id, secret)
    current ??= Object.freeze({ id, key: secret })
  }
  return Object.freeze({ current: current as Keyring['current'], byId, acceptUnsealed, acceptV1 })
}

function flag (option: string, value: unknown): boolean {
  if (value === undefined) return false
  if (typeof value !== 'boolean') throw refuse(option, 'true or false', value)
  return value
}

function isPlainObject (value: unknown): value is Record<string, unknown> {
  return value !== null && typeof value === 'object' && !Array.isArray(value) && !(value instanceof Uint8Array)
}

/**
 * An InvalidOptionError that keeps only the description of the value, also as its `received`:
 * whatever sits in this option may be a key (a Buffer, a hex or base64 string), and key material
 * must not stay reachable from an error object either.
 */
function refuse (option: string, expectation: string, value: unknown): InvalidOptionError {
  const description = describeValue(value)
  return new InvalidOptionError(option, expectation, description, description)
}
