import { randomBytes } from 'node:crypto'
import { OWN_BUFFER_OVERHEAD, Slabs } from './memory-packing.js'
import { freeSlot, NONE, slotOf, unindex } from './memory-slots.js'

/** No record (an index slot, a link, a lookup's answer). */
export { NONE }

/**
 * The memory store's completed records, packed outside the JS heap (a million completed records,
 * filled through the plugin, must fit in 500 MB). As JS objects they cost about 300 heap bytes
 * each (an object of twenty fields, boxed doubles, a key string, a Map slot) on top of their bytes,
 * and a heap that large stayed large: a million requests' garbage promoted around them left 669 MiB
 * of heap committed for 303 in use. Here a record is a row of numbers in two typed arrays, and its
 * key, digest and body are bytes in a slab (memory-packing.ts): the JS heap holds a few objects
 * whatever the number of records.
 *
 * - Rows are dense: deleting a row moves the last one into its place (its id changes), so there are
 *   no holes to skip and no free list, and the table shrinks (memory goes back, as the store's
 *   accounting test requires) once a quarter full, at any time. Ids are held within one synchronous
 *   call only, except by a walk from the top row down (a sweep in slices): see `delete`.
 * - The index is open addressing over ids (memory-slots.ts: linear probing, backward-shift deletion,
 *   so no tombstones pile up), by a hash of (bucket id, key) seeded per table: keys chosen to collide in one process
 *   do not collide in another.
 * - Each bucket's records are linked through their rows, so a scope at its share scans its own
 *   records and nobody else's (memory-records.ts).
 */

// A row's 32-bit fields, at id * INTS + field.
const HASH = 0
const BUCKET = 1
const SLAB = 2
/** Where its bytes start in the slab: the key, then the digest, then the body. */
const OFFSET = 3
/** The key's length in characters (see FLAGS for its bytes per character). */
const KEY = 4
const DIGEST = 5
/** The body's length (at most INT32_MAX: a longer one has memory of its own, and ends with it), or NOT_RETAINED. */
const BODY = 6
const STATUS = 7
/** Its header set's id (HeaderSets) and its fingerprint algorithm's (Names): the store's, kept as given. */
const HEADERS = 8
const ALGORITHM = 9
const FLAGS = 10
/** The next and previous records of its bucket. */
const NEXT = 11
const PREV = 12
const INTS = 13
// A row's times, at id * TIMES + field (ms since the epoch).
const EXPIRES = 0
const CREATED = 1
const TIMES = 2

/** FLAGS: the key is kept as UTF-16 (2 bytes a character) because it does not fit Latin-1 (1 byte). */
const WIDE_KEY = 1
/** FLAGS: the record was held for the reconciler before it completed (inspect() reports it). */
const INDETERMINATE = 2

const NOT_RETAINED = -1
const INT32_MAX = 0x7fffffff

/**
 * What one record takes in the table: its row (13 int32 fields, 2 float64) and the two index slots
 * each row has (the index has at least twice as many slots as there are rows).
 */
export const ROW_BYTES = INTS * 4 + TIMES * 8 + 2 * 4

export interface CompletedTableOptions {
  /** Rows allocated at first, and never fewer. @defaultValue 64 */
  readonly capacity?: number
  /** Rows never allocated beyond while there are no more records than that (the store's maxEntries). */
  readonly maxCapacity?: number
  /** The hash's seed. @defaultValue random */
  readonly seed?: number
}

/** A completed response, as `insert` takes it. */
export interface CompletedResponse {
  readonly statusCode: number
  readonly body: Buffer | null
}

export class CompletedTable {
  readonly #slabs = new Slabs()
  readonly #minCapacity: number
  readonly #maxCapacity: number
  readonly #seed: number
  #size = 0
  #capacity = 0
  #ints = new Int32Array(0)
  #times = new Float64Array(0)
  /** Ids by slot, NONE in a free slot; its length is a power of two, `#mask` + 1. */
  #index = new Int32Array(0)
  #mask = 0
  /** The first record of each bucket, by bucket id (NONE: it has none). */
  #heads = new Int32Array(0)

  constructor (options: CompletedTableOptions = {}) {
    this.#maxCapacity = Math.max(1, options.maxCapacity ?? Infinity)
    this.#minCapacity = Math.max(1, Math.min(options.capacity ?? 64, this.#maxCapacity))
    this.#seed = options.seed ?? randomBytes(4).readInt32LE(0)
    this.#resize(this.#minCapacity)
  }

  /** Records held; their ids are 0 to size - 1. */
  get size (): number { return this.#size }

  /** Rows allocated. */
  get capacity (): number { return this.#capacity }

  /** The id of `bucket`'s record under `key`, or NONE. */
  find (bucket: number, key: string): number {
    const hash = hashKey(this.#seed, bucket, key)
    const ints = this.#ints
    const index = this.#index
    const mask = this.#mask
    for (let slot = hash & mask; ; slot = (slot + 1) & mask) {
      const id = index[slot] as number
      if (id === NONE) return NONE
      const row = id * INTS
      if (ints[row + HASH] === hash && ints[row + BUCKET] === bucket && this.#keyIs(row, key)) return id
    }
    /* c8 ignore start: the index always has a free slot, so a probe ends at one and the loop only
       ends by returning; the end of the function, a block to V8, is never reached */
  }
  /* c8 ignore stop */

  /**
   * Adds a completed record of `bucket` under `key`, which must not be there yet, and returns its
   * id. Its key, digest and body are copied into a slab of its ttl (or memory of its own): nothing
   * of the caller's is kept.
   */
  insert (bucket: number, key: string, digest: Buffer, response: CompletedResponse, headers: number, algorithm: number,
    indeterminate: boolean, createdAt: number, expiresAt: number, ttlMs: number): number {
    if (this.#size === this.#capacity) this.#resize(Math.max(this.#size + 1, Math.min(this.#capacity * 2, this.#maxCapacity)))
    const keyBytes = keyBytesOf(key)
    const wide = keyBytes !== key.length
    const body = response.body
    const slabs = this.#slabs
    const offset = slabs.pack(keyBytes + digest.length + (body === null ? 0 : body.length), ttlMs)
    const slab = slabs.last
    const target = slabs.buffer(slab)
    // The key as its characters' code units (UTF-16LE when wide), not UTF-8: exact for every JS
    // string, lone surrogates included (UTF-8 turns each into U+FFFD, so two keys would be one).
    if (wide) {
      for (let i = 0, at = offset; i < key.length; i++, at += 2) {
        const code = key.charCodeAt(i)
        target[at] = code & 0xff
        target[at + 1] = code >>> 8
      }
    } else {
      for (let i = 0; i < key.length; i++) target[offset + i] = key.charCodeAt(i)
    }
    // TypedArray#set: a builtin, cheaper per call than Buffer#copy for these small copies.
    target.set(digest, offset + keyBytes)
    if (body !== null) target.set(body, offset + keyBytes + digest.length)

    const id = this.#size++
    const row = id * INTS
    const ints = this.#ints
    const hash = hashKey(this.#seed, bucket, key)
    ints[row + HASH] = hash
    ints[row + BUCKET] = bucket
    ints[row + SLAB] = slab
    ints[row + OFFSET] = offset
    ints[row + KEY] = key.length
    ints[row + DIGEST] = digest.length
    ints[row + BODY] = body === null ? NOT_RETAINED : Math.min(body.length, INT32_MAX)
    ints[row + STATUS] = response.statusCode
    ints[row + HEADERS] = headers
    ints[row + ALGORITHM] = algorithm
    ints[row + FLAGS] = (wide ? WIDE_KEY : 0) | (indeterminate ? INDETERMINATE : 0)
    this.#times[id * TIMES + EXPIRES] = expiresAt
    this.#times[id * TIMES + CREATED] = createdAt
    this.#link(id, bucket)
    this.#index[freeSlot(this.#index, this.#mask, hash)] = id
    return id
  }

  /**
   * Deletes record `id`; the last row moves into its place (the last id is no more). A walk from the
   * top row down that deletes as it goes stays correct: the row moved into a deleted one comes from
   * above the walk (already looked at, or added since), and rows below it never move above it. So
   * deleting ids in decreasing order is safe too (`expiredIn`).
   */
  delete (id: number): void {
    const ints = this.#ints
    const row = id * INTS
    unindex(this.#index, this.#mask, id, ints[row + HASH] as number, ints, INTS, HASH)
    this.#unlink(id)
    this.#slabs.release(ints[row + SLAB] as number)
    const last = --this.#size
    if (id !== last) this.#move(last, id)
    // Halved at a quarter full (not at half: a table at the boundary would be resized on every
    // insert and delete). Ids stay as they are, so a walk in progress is not disturbed.
    if (this.#size < this.#capacity / 4 && this.#capacity > this.#minCapacity) {
      this.#resize(Math.max(this.#minCapacity, Math.floor(this.#capacity / 2)))
    }
  }

  expiresAt (id: number): number { return this.#times[id * TIMES + EXPIRES] as number }
  createdAt (id: number): number { return this.#times[id * TIMES + CREATED] as number }
  bucketOf (id: number): number { return this.#ints[id * INTS + BUCKET] as number }
  statusCode (id: number): number { return this.#ints[id * INTS + STATUS] as number }
  headersOf (id: number): number { return this.#ints[id * INTS + HEADERS] as number }
  algorithmOf (id: number): number { return this.#ints[id * INTS + ALGORITHM] as number }
  indeterminate (id: number): boolean { return ((this.#ints[id * INTS + FLAGS] as number) & INDETERMINATE) !== 0 }

  /** A view of its fingerprint digest in the slab (no copy: a slab's bytes never change while a record uses them). */
  digest (id: number): Buffer {
    const ints = this.#ints
    const row = id * INTS
    const start = (ints[row + OFFSET] as number) + this.#keyBytes(row)
    return this.#slabs.buffer(ints[row + SLAB] as number).subarray(start, start + (ints[row + DIGEST] as number))
  }

  /** A view of its body in the slab, or null when the body was not retained. */
  body (id: number): Buffer | null {
    const ints = this.#ints
    const row = id * INTS
    const length = ints[row + BODY] as number
    if (length === NOT_RETAINED) return null
    const slab = ints[row + SLAB] as number
    const buffer = this.#slabs.buffer(slab)
    const start = (ints[row + OFFSET] as number) + this.#keyBytes(row) + (ints[row + DIGEST] as number)
    return buffer.subarray(start, this.#slabs.isOwn(slab) ? buffer.length : start + length)
  }

  /** The bytes it holds in slabs: its share of one (aligned as packed), or its own memory and that memory's overhead. */
  heldBytes (id: number): number {
    const ints = this.#ints
    const row = id * INTS
    const slab = ints[row + SLAB] as number
    if (this.#slabs.isOwn(slab)) return OWN_BUFFER_OVERHEAD + this.#slabs.buffer(slab).length
    const body = ints[row + BODY] as number
    return (this.#keyBytes(row) + (ints[row + DIGEST] as number) + (body === NOT_RETAINED ? 0 : body) + 7) & ~7
  }

  /**
   * What `heldBytes` will say of a record inserted now whose key, digest and body take `length`
   * bytes (`keyBytesOf` for the key) and whose ttl is `ttlMs`: the store counts a record before it
   * records it, so that a record that would not fit is never held, even for a moment.
   */
  heldBytesFor (length: number, ttlMs: number): number {
    return this.#slabs.packsInSlab(length, ttlMs) ? (length + 7) & ~7 : OWN_BUFFER_OVERHEAD + length
  }

  /** The ids of `bucket`'s records expired by `at`, highest first: the order to delete them in (see `delete`). */
  expiredIn (bucket: number, at: number): number[] {
    const expired: number[] = []
    if (bucket >= this.#heads.length) return expired
    for (let id = this.#heads[bucket] as number; id !== NONE; id = this.#ints[id * INTS + NEXT] as number) {
      if ((this.#times[id * TIMES + EXPIRES] as number) <= at) expired.push(id)
    }
    return expired.sort((a, b) => b - a)
  }

  clear (): void {
    this.#slabs.clear()
    this.#size = 0
    this.#heads = new Int32Array(0)
    this.#resize(this.#minCapacity)
  }

  /** Compared character by character: no copy of the key looked up, and no decoding of the stored one. */
  #keyIs (row: number, key: string): boolean {
    const ints = this.#ints
    const length = ints[row + KEY] as number
    if (length !== key.length) return false
    const slab = this.#slabs.buffer(ints[row + SLAB] as number)
    const start = ints[row + OFFSET] as number
    if (((ints[row + FLAGS] as number) & WIDE_KEY) === 0) {
      for (let i = 0; i < length; i++) {
        if (slab[start + i] !== key.charCodeAt(i)) return false
      }
    } else {
      for (let i = 0, at = start; i < length; i++, at += 2) {
        if (((slab[at] as number) | (slab[at + 1] as number) << 8) !== key.charCodeAt(i)) return false
      }
    }
    return true
  }

  #keyBytes (row: number): number {
    const length = this.#ints[row + KEY] as number
    return ((this.#ints[row + FLAGS] as number) & WIDE_KEY) === 0 ? length : length * 2
  }

  #link (id: number, bucket: number): void {
    if (bucket >= this.#heads.length) {
      const heads = new Int32Array(Math.max(bucket + 1, this.#heads.length * 2, 8)).fill(NONE)
      heads.set(this.#heads)
      this.#heads = heads
    }
    const ints = this.#ints
    const head = this.#heads[bucket] as number
    ints[id * INTS + NEXT] = head
    ints[id * INTS + PREV] = NONE
    if (head !== NONE) ints[head * INTS + PREV] = id
    this.#heads[bucket] = id
  }

  #unlink (id: number): void {
    const ints = this.#ints
    const row = id * INTS
    const next = ints[row + NEXT] as number
    const prev = ints[row + PREV] as number
    if (prev === NONE) this.#heads[ints[row + BUCKET] as number] = next
    else ints[prev * INTS + NEXT] = next
    if (next !== NONE) ints[next * INTS + PREV] = prev
  }

  /** Moves row `from` into the unused row `to`, and whatever named `from` (its index slot, its neighbours) with it. */
  #move (from: number, to: number): void {
    const ints = this.#ints
    this.#index[slotOf(this.#index, this.#mask, from, ints[from * INTS + HASH] as number)] = to
    ints.copyWithin(to * INTS, from * INTS, from * INTS + INTS)
    this.#times.copyWithin(to * TIMES, from * TIMES, from * TIMES + TIMES)
    const row = to * INTS
    const next = ints[row + NEXT] as number
    const prev = ints[row + PREV] as number
    if (prev === NONE) this.#heads[ints[row + BUCKET] as number] = to
    else ints[prev * INTS + NEXT] = to
    if (next !== NONE) ints[next * INTS + PREV] = to
  }

  /** New arrays of `capacity` rows holding the rows there are, and an index rebuilt for them. */
  #resize (capacity: number): void {
    const ints = new Int32Array(capacity * INTS)
    const times = new Float64Array(capacity * TIMES)
    ints.set(this.#ints.subarray(0, this.#size * INTS))
    times.set(this.#times.subarray(0, this.#size * TIMES))
    this.#ints = ints
    this.#times = times
    this.#capacity = capacity
    // At most half full: linear probing's runs stay short.
    let slots = 2
    while (slots < capacity * 2) slots *= 2
    this.#index = new Int32Array(slots).fill(NONE)
    this.#mask = slots - 1
    for (let id = 0; id < this.#size; id++) this.#index[freeSlot(this.#index, this.#mask, ints[id * INTS + HASH] as number)] = id
  }
}

/**
 * The bytes a key takes in a record: one per character when every character fits Latin-1, else two
 * (UTF-16, see `insert`).
 */
export function keyBytesOf (key: string): number {
  for (let i = 0; i < key.length; i++) {
    if (key.charCodeAt(i) > 0xff) return key.length * 2
  }
  return key.length
}

/**
 * What a record whose key, digest and body take `length` bytes holds in slabs at most, wherever it
 * is packed: in memory of its own it holds that memory and its overhead, more than its aligned share
 * of a slab (at most 7 bytes of padding).
 */
export function heldBytesAtMost (length: number): number {
  return OWN_BUFFER_OVERHEAD + length
}

/**
 * A 32-bit hash of (bucket id, key): FNV-1a over the key's UTF-16 code units from a seeded state,
 * then murmur3's finalizer (the index takes the low bits, which FNV's multiply leaves poorly mixed).
 * Exported for the tests, which look for two keys of equal hash.
 */
export function hashKey (seed: number, bucket: number, key: string): number {
  let hash = seed ^ Math.imul(bucket + 1, 0x9e3779b1)
  for (let i = 0; i < key.length; i++) hash = Math.imul(hash ^ key.charCodeAt(i), 0x01000193)
  hash ^= hash >>> 16
  hash = Math.imul(hash, 0x85ebca6b)
  hash ^= hash >>> 13
  hash = Math.imul(hash, 0xc2b2ae35)
  hash ^= hash >>> 16
  return hash
}
