import { randomBytes } from 'node:crypto'
import { freeSlot, NONE, slotOf, unindex } from './memory-slots.js'
import { hashKey } from './memory-table.js'

/**
 * A scope's records in progress, by key: what a `Map<string, E>` would hold, without a `Map`.
 *
 * A record is in progress for one request, so this set gains and loses a key on every fresh
 * request. A `Map` that churns like this rehashes its table every few operations (to drop deleted
 * entries, or to shrink), and V8 allocates the new table in the old generation once the map itself
 * lives there: about 150 bytes of old-generation garbage per request, measured with a young
 * generation large enough that nothing was promoted. At 17,000 fresh keys a second that was some
 * 2.5 MB a second for full mark-compacts to collect (5–12 ms pauses each, about every second, where
 * bare Fastify ran none). Here the entries sit in
 * arrays that are written in place: adding and removing allocate nothing until the arrays grow or
 * shrink.
 *
 * - Dense: removing an entry moves the last one into its place, so a walk needs no holes to skip.
 * - The index is open addressing over positions (memory-slots.ts, as the table's), by the table's
 *   seeded hash of the key (memory-table.ts `hashKey`).
 */

/** Positions allocated at first, and never fewer: most scopes have a handful of requests in flight. */
const MIN_CAPACITY = 8

/**
 * One seed for every index of the process: keys that collide in one process do not collide in
 * another, and a scope created per tenant costs no random bytes.
 */
const SEED = randomBytes(4).readInt32LE(0)

/** The bucket id hashKey mixes in: one index holds one scope's keys. */
const BUCKET = 0

/**
 * What the arrays start as, until the constructor sizes them: shared, because an empty Int32Array
 * takes V8's slow path (some 200 ns each, measured), and a scope's first record builds an index.
 */
const EMPTY = new Int32Array(0)

export class PendingIndex<E> {
  #size = 0
  #capacity = 0
  #keys: string[] = []
  #entries: Array<E | undefined> = []
  #hashes = EMPTY
  /** Positions by slot, NONE in a free slot; its length is a power of two, `#mask` + 1. */
  #index = EMPTY
  #mask = 0

  constructor () {
    this.#resize(MIN_CAPACITY)
  }

  get size (): number { return this.#size }

  get (key: string): E | undefined {
    const at = this.#find(key, hashKey(SEED, BUCKET, key))
    return at === NONE ? undefined : this.#entries[at]
  }

  set (key: string, entry: E): void {
    const hash = hashKey(SEED, BUCKET, key)
    const found = this.#find(key, hash)
    if (found !== NONE) {
      this.#entries[found] = entry
      return
    }
    if (this.#size === this.#capacity) this.#resize(this.#capacity * 2)
    const at = this.#size++
    this.#keys[at] = key
    this.#entries[at] = entry
    this.#hashes[at] = hash
    this.#index[freeSlot(this.#index, this.#mask, hash)] = at
  }

  /** Whether `key` was there. The last entry takes its position. */
  delete (key: string): boolean {
    const hash = hashKey(SEED, BUCKET, key)
    const at = this.#find(key, hash)
    if (at === NONE) return false
    unindex(this.#index, this.#mask, at, hash, this.#hashes, 1, 0)
    const last = --this.#size
    if (at !== last) {
      const moved = this.#hashes[last] as number
      this.#index[slotOf(this.#index, this.#mask, last, moved)] = at
      this.#keys[at] = this.#keys[last] as string
      this.#entries[at] = this.#entries[last]
      this.#hashes[at] = moved
    }
    // Nothing is kept alive by a free position.
    this.#keys[last] = ''
    this.#entries[last] = undefined
    // Halved at a quarter full, not at half: a set at the boundary would be resized on every change.
    if (this.#capacity > MIN_CAPACITY && this.#size < this.#capacity / 4) this.#resize(this.#capacity / 2)
    return true
  }

  /**
   * Every entry, from the last position down. Deleting entries meanwhile (even between two steps of
   * a walk that yields to the event loop) is safe: a position is filled from above the walk (already
   * seen, or added since, which the walk may skip), and positions below it never move above it. An
   * entry moved down from above may be seen twice; callers check what they find.
   */
  * values (): IterableIterator<E> {
    for (let at = this.#size - 1; at >= 0; at = Math.min(at, this.#size) - 1) yield this.#entries[at] as E
  }

  #find (key: string, hash: number): number {
    const index = this.#index
    const hashes = this.#hashes
    const keys = this.#keys
    const mask = this.#mask
    for (let slot = hash & mask; ; slot = (slot + 1) & mask) {
      const at = index[slot] as number
      if (at === NONE) return NONE
      if (hashes[at] === hash && keys[at] === key) return at
    }
    /* c8 ignore start: the index always has a free slot, so a probe ends at one and the loop only
       ends by returning; the end of the function, a block to V8, is never reached */
  }
  /* c8 ignore stop */

  #resize (capacity: number): void {
    const size = this.#size
    // Filled, not holey, so V8 keeps each array's elements packed.
    const keys = new Array<string>(capacity).fill('')
    const entries = new Array<E | undefined>(capacity).fill(undefined)
    const hashes = new Int32Array(capacity)
    for (let at = 0; at < size; at++) {
      keys[at] = this.#keys[at] as string
      entries[at] = this.#entries[at]
      hashes[at] = this.#hashes[at] as number
    }
    this.#keys = keys
    this.#entries = entries
    this.#hashes = hashes
    this.#capacity = capacity
    // At most half full: linear probing's runs stay short.
    this.#index = new Int32Array(capacity * 2).fill(NONE)
    this.#mask = capacity * 2 - 1
    for (let at = 0; at < size; at++) this.#index[freeSlot(this.#index, this.#mask, hashes[at] as number)] = at
  }
}
