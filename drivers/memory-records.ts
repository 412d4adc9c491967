/**
 * The memory store's records by (scope, key): a map of scopes, each a bucket holding a map of keys.
 * A million records is the target scale, and a key built from both (`${scope.length}:${scope}${key}`)
 * was a string of its own per record, a rope of three that V8 flattened on every lookup, on top of
 * the key it was built from. Scopes are few and shared; the key is kept once, as a compact copy (the
 * parser hands keys over as slices of the header's string, which would keep that string alive too).
 *
 * A scope's bucket also carries what the scope holds (its records and bytes), so the store can bound
 * each scope to its share (issue 16: one tenant must not fill the store for every tenant) with a
 * counter read per claim, not a scan. A record points at its bucket (in place of its scope string:
 * no extra field), so deleting a record needs no lookup of its scope.
 */

/** One scope's records and what they hold. */
export class Bucket<E> {
  readonly keys = new Map<string, E>()
  /** Bytes the scope's records hold, counted as the store counts them against `maxBytesPerScope`. */
  bytes = 0
  /** When the scope's own expired records were last swept to make room in its share (ms). */
  lastPurge = -Infinity

  constructor (readonly scope: string) {}
}

export interface Keyed<E> {
  readonly bucket: Bucket<E>
  readonly key: string
}

/** Latin-1 text (every key the plugin accepts is ASCII) is copied into a string of its own. */
const LATIN1 = /^[\x00-\xff]*$/

export function compactKey (key: string): string {
  return LATIN1.test(key) ? Buffer.from(key, 'latin1').toString('latin1') : key
}

export class Records<E extends Keyed<E>> {
  readonly #scopes = new Map<string, Bucket<E>>()
  #size = 0

  get size (): number { return this.#size }

  /** How many scopes hold at least one record. */
  get scopes (): number { return this.#scopes.size }

  get (scope: string, key: string): E | undefined {
    return this.#scopes.get(scope)?.keys.get(key)
  }

  /** The scope's bucket: the one in use, or a new one that `add` registers with its first record. */
  bucketOf (scope: string): Bucket<E> {
    return this.#scopes.get(scope) ?? new Bucket<E>(scope)
  }

  /** Adds `entry` (its bucket from `bucketOf`), which must not be there yet. */
  add (entry: E): void {
    const bucket = entry.bucket
    // A bucket whose last record went (a purge while this claim made room) is registered again.
    if (bucket.keys.size === 0) this.#scopes.set(bucket.scope, bucket)
    bucket.keys.set(entry.key, entry)
    this.#size++
  }

  /** Deletes `entry`; false when it was not there (so nothing it held is counted off twice). */
  delete (entry: E): boolean {
    const bucket = entry.bucket
    if (bucket.keys.get(entry.key) !== entry) return false
    bucket.keys.delete(entry.key)
    this.#size--
    // A scope's bucket goes with its last record: scopes come and go (tenants), they must not pile up.
    if (bucket.keys.size === 0 && this.#scopes.get(bucket.scope) === bucket) this.#scopes.delete(bucket.scope)
    return true
  }

  /** Every record; deleting records meanwhile is safe (Map iteration skips what was deleted). */
  * [Symbol.iterator] (): IterableIterator<E> {
    for (const bucket of this.#scopes.values()) yield * bucket.keys.values()
  }

  clear (): void {
    this.#scopes.clear()
    this.#size = 0
  }
}
