import { hash } from 'node:crypto'
import type { RecordId } from '../../lib/core/store.js'

/**
 * The Redis key of the hash that holds everything for one (scope, key): `${prefix}:{${tag}}`.
 *
 * `tag` is base64url(SHA-256(length-prefixed scope, key)):
 * - injective in practice: the scope's length (in UTF-16 code units) comes first and both strings are
 *   hashed as UTF-16LE, which encodes every JS string (lone surrogates included) to distinct bytes,
 *   so ('a', 'b:c') and ('a:b', 'c') hash different inputs, and no scope can spell another's key;
 * - nothing the client sent reaches Redis as a key: no quoting, braces or length to worry about;
 * - the braces make the tag a cluster hash tag, so every key of one (scope, key) lands in one slot
 *   and the Lua scripts never touch two slots (no CROSSSLOT on Redis Cluster). base64url has no
 *   braces, so the tag always ends at our closing brace.
 */
export function recordKey (prefix: string, id: RecordId): string {
  // The same bytes as hashing `${length}:` then both strings as UTF-16LE, in one buffer and one
  // call: this runs for every pre-filter operation.
  const head = `${id.scope.length}:`
  const bytes = Buffer.allocUnsafe(head.length + 2 * (id.scope.length + id.key.length))
  bytes.write(head, 0, 'latin1')
  bytes.write(id.scope, head.length, 'utf16le')
  bytes.write(id.key, head.length + 2 * id.scope.length, 'utf16le')
  return `${prefix}:{${hash('sha256', bytes, 'base64url')}}`
}

/**
 * Field names of the hash. Short, since each is stored once per record; the meaning of each value
 * is documented in scripts.ts, where they are written.
 */
export const FIELD = Object.freeze({
  state: 'state',
  algorithm: 'alg',
  digest: 'digest',
  status: 'status',
  headers: 'headers',
  /** Present only when the body was retained: its absence is the "not retained" (null body) marker. */
  body: 'body',
  /** An in-flight marker's owner token (scripts.ts); a marker without one is nobody's to clear. */
  owner: 'owner'
})
