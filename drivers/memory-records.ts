import { PendingIndex } from './memory-pending.js'

/**
 * The memory store's scopes: a map of scopes, each a bucket. A bucket holds the scope's records in
 * progress by key (JS objects: few at a time, and they carry tokens, leases and steps; indexed by a
 * PendingIndex); its completed records are rows of the table (memory-table.ts), which names the
 * bucket by a number, its id, so that a row holds no reference. A scope's key was once joined with
 * its scope into one string (`${scope.length}:${scope}${key}`): a string of its own per record, a
 * rope of three that V8 flattened on every lookup. Scopes are few and shared.
 *
 * A scope's bucket also carries what the scope holds (its records and bytes), so the store can keep
 * each scope's share for it (one tenant must not fill the store for every tenant) with counters read
 * per claim, not a scan. A record in progress points at its bucket (in place of its scope string: no
 * extra field), so deleting a record needs no lookup of its scope.
 */

/** One scope's records and what they hold. */
export class Bucket<E> {
  /** Its records in progress, by key (not a Map: memory-pending.ts says why). */
  readonly pending = new PendingIndex<E>()
  /** Its records, in progress and completed: what `maxEntriesPerScope` is compared with. */
  records = 0
  /** Bytes the scope's records hold, counted as the store counts them against `maxBytes` and `maxBytesPerScope`. */
  bytes = 0
  /** When the scope's own expired records were last swept to make room for it (ms). */
  lastPurge = -Infinity
  /** What the table's rows name it by while it holds records; -1 before its first and after its last. */
  id = -1

  constructor (readonly scope: string) {}
}

/** Latin-1 text (every key the plugin accepts is ASCII) is copied into a string of its own. */
// eslint-disable-next-line no-control-regex -- the whole Latin-1 range, controls included
const LATIN1 = /^[\x00-\xff]*$/

/**
 * The key a record in progress keeps: a compact copy (the parser hands keys over as slices of the
 * header's string, which would keep that string alive too).
 */
export function compactKey (key: string): string {
  return LATIN1.test(key) ? Buffer.from(key, 'latin1').toString('latin1') : key
}

export class Buckets<E> {
  readonly #scopes = new Map<string, Bucket<E>>()
  /** The buckets holding records, by id (null: a free id). */
  readonly #byId: Array<Bucket<E> | null> = []
  readonly #freeIds: number[] = []
  #records = 0
  #recordsWithinShares = 0

  /** `share`: the records each scope is guaranteed (the store's `maxEntriesPerScope`). */
  constructor (readonly share: number) {}

  /** Records of every scope, in progress and completed. */
  get records (): number { return this.#records }

  /**
   * The sum over scopes of their records up to their share (`min(records, share)`): what the scopes
   * holding records use of their shares, so the room they may still claim within them is
   * `scopes * share - recordsWithinShares`, known without a scan.
   */
  get recordsWithinShares (): number { return this.#recordsWithinShares }

  /** How many scopes hold at least one record. */
  get scopes (): number { return this.#scopes.size }

  /** The scope's bucket, if it holds records. */
  find (scope: string): Bucket<E> | undefined {
    return this.#scopes.get(scope)
  }

  /** The scope's bucket: the one in use, or a new one that `added` registers with its first record. */
  bucketOf (scope: string): Bucket<E> {
    return this.#scopes.get(scope) ?? new Bucket<E>(scope)
  }

  byId (id: number): Bucket<E> {
    return this.#byId[id] as Bucket<E>
  }

  /** One more record in `bucket` (from `bucketOf`): its first registers it, and gives it an id. */
  added (bucket: Bucket<E>): void {
    // A bucket whose last record went (a purge while this claim made room) is registered again.
    if (bucket.records < this.share) this.#recordsWithinShares++
    if (bucket.records++ === 0) {
      bucket.id = this.#freeIds.pop() ?? this.#byId.length
      this.#byId[bucket.id] = bucket
      this.#scopes.set(bucket.scope, bucket)
    }
    this.#records++
  }

  /** One record fewer in `bucket`. A scope's bucket goes with its last record: scopes come and go (tenants), they must not pile up. */
  removed (bucket: Bucket<E>): void {
    this.#records--
    if (bucket.records <= this.share) this.#recordsWithinShares--
    if (--bucket.records > 0) return
    if (this.#scopes.get(bucket.scope) === bucket) this.#scopes.delete(bucket.scope)
    // No row names it any more: the id can name another scope.
    this.#byId[bucket.id] = null
    this.#freeIds.push(bucket.id)
    bucket.id = -1
  }

  /** Every record in progress; deleting records meanwhile is safe (PendingIndex.values says how). */
  * pending (): IterableIterator<E> {
    for (const bucket of this.#scopes.values()) yield * bucket.pending.values()
  }

  clear (): void {
    this.#scopes.clear()
    this.#byId.length = 0
    this.#freeIds.length = 0
    this.#records = 0
    this.#recordsWithinShares = 0
  }
}
