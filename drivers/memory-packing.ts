/**
 * Compact storage of completed records for the memory store. A million records is the target
 * scale, and per-record overhead dominates small bodies: every Buffer with its own memory costs a
 * few hundred bytes of bookkeeping on top of its bytes, and every copied headers object another
 * hundred. So a completed record keeps its key, fingerprint digest and body as bytes in a shared
 * slab (at an offset its row in the table holds, memory-table.ts), and identical header sets share
 * one frozen object.
 *
 * Sharing must not hold memory the store does not count: a slab lives as long as its
 * longest-lived record, and an interned header set as long as the table keeps it. So slabs are
 * shared only by records of one ttl, which expire in the order they were written, and slabs and
 * header sets are counted by reference and go with their last record.
 *
 * Records name slabs, header sets and algorithm names by id (a number in a typed array) rather than
 * by reference: one object per record is what the table exists to avoid.
 */

/** Records larger than this get memory of their own, so a large body never pins a slab. */
const SLAB_RECORD_LIMIT = 8 * 1024
const SLAB_SIZE = 256 * 1024
/**
 * How many distinct ttls get slabs; a record of any other ttl gets memory of its own. The plugin
 * passes one ttl per route, so a handful; a caller of the store interface passing a new ttl with
 * every record must not make a slab of each.
 */
const COHORTS = 8
/** What a Buffer with memory of its own costs beyond its bytes (its objects and allocation). */
export const OWN_BUFFER_OVERHEAD = 96

/** The records of one ttl: the slab they are being packed into (its id, or -1 before the first). */
interface Cohort {
  slab: number
  offset: number
}

export class Slabs {
  /** By id; null once free (the id is then reused). */
  readonly #buffers: Array<Buffer | null> = []
  /**
   * References to each: one per record packed into it, and its cohort's own while it is the one
   * being filled (so a slab whose records all went early is kept for the records still to come).
   */
  readonly #refs: number[] = []
  /** Whether each is a record's memory of its own (its overhead is then the record's). */
  readonly #own: boolean[] = []
  readonly #freeIds: number[] = []
  readonly #cohorts = new Map<number, Cohort>()
  // Nearly every store has one ttl: the last cohort is kept at hand, without a map lookup.
  #lastTtl = Number.NaN
  #lastCohort: Cohort | null = null
  #last = -1

  /** The id of the buffer the last `pack` reserved room in (a slab, or a record's own). */
  get last (): number { return this.#last }

  buffer (id: number): Buffer {
    return this.#buffers[id] as Buffer
  }

  isOwn (id: number): boolean {
    return this.#own[id] === true
  }

  /**
   * Reserves `length` bytes of fresh memory for one record and returns their offset in the buffer
   * `last` names, which holds one more reference until `release`. Small records of one ttl share
   * slabs: they expire in the order they were written (written at t, gone at t + ttl), so a slab
   * goes soon after its last record, and outlives its first by at most the time it took to fill. A
   * slab shared by records of different ttls would live as long as its longest-lived record: one
   * tiny record with a long ttl in each kept 256 KiB of short-lived neighbours alive, uncounted.
   * The caller copies into it (never aliasing its caller's, possibly pooled, buffers).
   */
  pack (length: number, ttlMs: number): number {
    const cohort = length > SLAB_RECORD_LIMIT ? null : ttlMs === this.#lastTtl ? this.#lastCohort : this.#cohortOf(ttlMs)
    let id: number
    let offset: number
    if (cohort === null) {
      id = this.#add(Buffer.allocUnsafeSlow(length), true)
      offset = 0
    } else {
      if (cohort.slab === -1 || cohort.offset + length > SLAB_SIZE) {
        const full = cohort.slab
        cohort.slab = this.#add(Buffer.allocUnsafeSlow(SLAB_SIZE), false)
        cohort.offset = 0
        // The cohort's own reference: the full slab now goes with its last record.
        if (full !== -1) this.release(full)
      }
      id = cohort.slab
      offset = cohort.offset
      // 8-byte alignment: each record starts on a word boundary, where the copies into it begin.
      cohort.offset += (length + 7) & ~7
    }
    this.#refs[id] = (this.#refs[id] as number) + 1
    this.#last = id
    return offset
  }

  /**
   * Whether `pack(length, ttlMs)` would put the record in a shared slab (else in memory of its own),
   * changing nothing: the store counts a record before it records it.
   */
  packsInSlab (length: number, ttlMs: number): boolean {
    if (length > SLAB_RECORD_LIMIT) return false
    return ttlMs === this.#lastTtl || this.#cohorts.has(ttlMs) || this.#cohorts.size < COHORTS
  }

  /** One reference fewer: the last one frees the buffer (for the GC) and its id (for reuse). */
  release (id: number): void {
    const refs = (this.#refs[id] as number) - 1
    this.#refs[id] = refs
    if (refs > 0) return
    this.#buffers[id] = null
    this.#freeIds.push(id)
  }

  #add (buffer: Buffer, own: boolean): number {
    const id = this.#freeIds.pop() ?? this.#buffers.length
    this.#buffers[id] = buffer
    // A slab starts with its cohort's reference; a record's own memory with none (pack adds the record's).
    this.#refs[id] = own ? 0 : 1
    this.#own[id] = own
    return id
  }

  #cohortOf (ttlMs: number): Cohort | null {
    let cohort = this.#cohorts.get(ttlMs)
    if (cohort === undefined) {
      if (this.#cohorts.size >= COHORTS) return null
      cohort = { slab: -1, offset: 0 }
      this.#cohorts.set(ttlMs, cohort)
    }
    this.#lastTtl = ttlMs
    this.#lastCohort = cohort
    return cohort
  }

  clear (): void {
    this.#buffers.length = 0
    this.#refs.length = 0
    this.#own.length = 0
    this.#freeIds.length = 0
    this.#cohorts.clear()
    this.#lastTtl = Number.NaN
    this.#lastCohort = null
    this.#last = -1
  }
}

export type Headers = Readonly<Record<string, string | readonly string[]>>

/**
 * A recorded header set, frozen deep down: its arrays are copies of the caller's, frozen too, so
 * neither the caller that recorded it nor one that read it can change a record (an app hook that
 * appends to a replayed header array in place must not change other tenants' replays). Shared by
 * every record with identical headers while it is interned.
 */
export class HeaderSet {
  /** Records using it. */
  refs = 0

  constructor (
    /** What records name it by, in the HeaderSets that made it. */
    readonly id: number,
    readonly value: Headers,
    /** Bytes counted for each record that uses it: the names' and values' characters. */
    readonly bytes: number,
    /** Its key in the table that interned it, or null when it is a record's own. */
    readonly signature: string | null,
    readonly table: Map<string, HeaderSet> | null
  ) {}
}

/** Sets larger than this are not interned: the table would hold a second copy (the signature) of each. */
const INTERN_BYTES_LIMIT = 4096
/** Interned sets at most, per table: hostile variety cannot grow it. */
const INTERNED_HEADER_SETS = 1024

/**
 * Frozen header sets shared between records, each dropped from the table with its last record.
 * Every set in use, interned or a record's own, has an id until its last record goes.
 */
export class HeaderSets {
  readonly #sets = new Map<string, HeaderSet>()

  /** The sets that hold one Content-Type alone (nearly every response), by its value: no signature to build. */
  readonly #byContentType = new Map<string, HeaderSet>()

  /** Every set in use, by id (null: a free id). */
  readonly #byId: Array<HeaderSet | null> = []
  readonly #freeIds: number[] = []

  /** The set to record for `headers` (one more reference to it); `release` its id when the record goes. */
  intern (headers: Readonly<Record<string, string | readonly string[]>>): HeaderSet {
    const names = Object.keys(headers)
    const only = names.length === 1 && names[0] === 'content-type' ? headers['content-type'] : undefined
    let set: HeaderSet | undefined
    if (typeof only === 'string') {
      set = this.#byContentType.get(only)
      if (set === undefined) {
        const table = this.#byContentType.size < INTERNED_HEADER_SETS ? this.#byContentType : null
        set = this.#add(Object.freeze({ 'content-type': only }), 'content-type'.length + only.length, table === null ? null : only, table)
        table?.set(only, set)
      }
    } else {
      const bytes = headerBytes(headers, names)
      const signature = bytes <= INTERN_BYTES_LIMIT ? JSON.stringify(headers) : null
      set = signature === null ? undefined : this.#sets.get(signature)
      if (set === undefined) {
        const table = signature !== null && this.#sets.size < INTERNED_HEADER_SETS ? this.#sets : null
        set = this.#add(frozenCopy(headers, names), bytes, table === null ? null : signature, table)
        if (table !== null) table.set(signature as string, set)
      }
    }
    set.refs++
    return set
  }

  byId (id: number): HeaderSet {
    return this.#byId[id] as HeaderSet
  }

  /** One reference fewer: the last one takes the set out of its table and frees its id, so the GC can free it. */
  release (id: number): void {
    const set = this.#byId[id] as HeaderSet
    if (--set.refs > 0) return
    this.#byId[id] = null
    this.#freeIds.push(id)
    if (set.table !== null && set.table.get(set.signature as string) === set) set.table.delete(set.signature as string)
  }

  #add (value: Headers, bytes: number, signature: string | null, table: Map<string, HeaderSet> | null): HeaderSet {
    const set = new HeaderSet(this.#freeIds.pop() ?? this.#byId.length, value, bytes, signature, table)
    this.#byId[set.id] = set
    return set
  }

  clear (): void {
    this.#sets.clear()
    this.#byContentType.clear()
    this.#byId.length = 0
    this.#freeIds.length = 0
  }
}

/**
 * Strings shared by completed records, by id, counted by reference: their fingerprints' algorithm
 * names (a few per app: one per fingerprint function, and per key of an encryption keyring).
 */
export class Names {
  readonly #ids = new Map<string, number>()
  /** By id (null: a free id). */
  readonly #names: Array<string | null> = []
  readonly #refs: number[] = []
  readonly #freeIds: number[] = []

  /** The id of `name`, with one more reference to it; `release` it when the record goes. */
  intern (name: string): number {
    let id = this.#ids.get(name)
    if (id === undefined) {
      id = this.#freeIds.pop() ?? this.#names.length
      this.#ids.set(name, id)
      this.#names[id] = name
      this.#refs[id] = 0
    }
    this.#refs[id] = (this.#refs[id] as number) + 1
    return id
  }

  name (id: number): string {
    return this.#names[id] as string
  }

  release (id: number): void {
    const refs = (this.#refs[id] as number) - 1
    this.#refs[id] = refs
    if (refs > 0) return
    this.#ids.delete(this.#names[id] as string)
    this.#names[id] = null
    this.#freeIds.push(id)
  }

  clear (): void {
    this.#ids.clear()
    this.#names.length = 0
    this.#refs.length = 0
    this.#freeIds.length = 0
  }
}

function frozenCopy (headers: Readonly<Record<string, string | readonly string[]>>, names: string[]): Headers {
  const copy: Record<string, string | readonly string[]> = {}
  for (const name of names) {
    const value: unknown = headers[name]
    // Strings are immutable already; an array is the caller's, so it is copied (and frozen).
    copy[name] = typeof value === 'string' ? value : Array.isArray(value) ? Object.freeze(value.map(String)) : String(value)
  }
  return Object.freeze(copy)
}

function headerBytes (headers: Readonly<Record<string, string | readonly string[]>>, names: string[]): number {
  let size = 0
  for (const name of names) {
    const value = headers[name]
    size += name.length
    if (typeof value === 'string') size += value.length
    else if (value !== undefined) for (const item of value) size += String(item).length
  }
  return size
}
