/**
 * Compact storage of completed records for the memory store. A million records is the target
 * scale, and per-record overhead dominates small bodies: every Buffer with its own memory costs a
 * few hundred bytes of bookkeeping on top of its bytes, and every copied headers object another
 * hundred. So a completed record keeps its fingerprint digest and body as one view into a shared
 * slab, and identical header sets share one frozen object.
 *
 * Sharing must not hold memory the store does not count (issue 16): a slab lives as long as its
 * longest-lived record, and an interned header set as long as the table keeps it. So slabs are
 * shared only by records of one ttl, which expire in the order they were written, and interned sets
 * are counted by reference and leave the table with their last record.
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

/** The records of one ttl: the slab they are being packed into. */
interface Cohort {
  slab: Buffer | null
  offset: number
}

export class Slabs {
  readonly #cohorts = new Map<number, Cohort>()
  // Nearly every store has one ttl: the last cohort is kept at hand, without a map lookup.
  #lastTtl = Number.NaN
  #lastCohort: Cohort | null = null
  #last: Buffer = Buffer.alloc(0)
  #own = false

  /** The buffer the last `pack` wrote to (a slab, or a record's own). */
  get last (): Buffer { return this.#last }

  /** Whether the last `pack` gave the record memory of its own (its overhead is then the record's). */
  get own (): boolean { return this.#own }

  /**
   * Copies `first` then `second` into fresh memory and returns their offset in `last`. Small
   * records of one ttl share slabs: they expire in the order they were written (written at t, gone
   * at t + ttl), so a slab is garbage soon after its last record goes, and outlives its first by at
   * most the time it took to fill. A slab shared by records of different ttls would live as long as
   * its longest-lived record: one tiny record with a long ttl in each kept 256 KiB of short-lived
   * neighbours alive, uncounted. Copying never aliases the caller's (possibly pooled) buffers. The
   * caller keeps (buffer, offset, length) rather than a view: a view is an object of its own per
   * record.
   */
  pack (first: Buffer, second: Buffer | null, ttlMs: number): number {
    const length = first.length + (second?.length ?? 0)
    const cohort = length > SLAB_RECORD_LIMIT ? null : ttlMs === this.#lastTtl ? this.#lastCohort : this.#cohortOf(ttlMs)
    let target: Buffer
    let offset: number
    if (cohort === null) {
      target = Buffer.allocUnsafeSlow(length)
      offset = 0
    } else {
      if (cohort.slab === null || cohort.offset + length > SLAB_SIZE) {
        cohort.slab = Buffer.allocUnsafeSlow(SLAB_SIZE)
        cohort.offset = 0
      }
      target = cohort.slab
      offset = cohort.offset
      // 8-byte alignment keeps views cheap to create and compare.
      cohort.offset += (length + 7) & ~7
    }
    // TypedArray#set: a builtin, cheaper per call than Buffer#copy for these small copies.
    target.set(first, offset)
    if (second !== null) target.set(second, offset + first.length)
    this.#last = target
    this.#own = cohort === null
    return offset
  }

  #cohortOf (ttlMs: number): Cohort | null {
    let cohort = this.#cohorts.get(ttlMs)
    if (cohort === undefined) {
      if (this.#cohorts.size >= COHORTS) return null
      cohort = { slab: null, offset: 0 }
      this.#cohorts.set(ttlMs, cohort)
    }
    this.#lastTtl = ttlMs
    this.#lastCohort = cohort
    return cohort
  }

  clear (): void {
    this.#cohorts.clear()
    this.#lastTtl = Number.NaN
    this.#lastCohort = null
    this.#last = Buffer.alloc(0)
  }
}

export type Headers = Readonly<Record<string, string | readonly string[]>>

/**
 * A recorded header set, frozen deep down: its arrays are copies of the caller's, frozen too, so
 * neither the caller that recorded it nor one that read it can change a record (issue 16: an app
 * hook appending to a replayed header array in place changed other tenants' replays). Shared by
 * every record with identical headers while it is interned.
 */
export class HeaderSet {
  /** Records using it. */
  refs = 0

  constructor (
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

/** Frozen header sets shared between records, each dropped from the table with its last record. */
export class HeaderSets {
  readonly #sets = new Map<string, HeaderSet>()

  /** The sets that hold one Content-Type alone (nearly every response), by its value: no signature to build. */
  readonly #byContentType = new Map<string, HeaderSet>()

  /** The set to record for `headers` (one more reference to it); `release` it when the record goes. */
  intern (headers: Readonly<Record<string, string | readonly string[]>>): HeaderSet {
    const names = Object.keys(headers)
    const only = names.length === 1 && names[0] === 'content-type' ? headers['content-type'] : undefined
    let set: HeaderSet | undefined
    if (typeof only === 'string') {
      set = this.#byContentType.get(only)
      if (set === undefined) {
        const table = this.#byContentType.size < INTERNED_HEADER_SETS ? this.#byContentType : null
        set = new HeaderSet(Object.freeze({ 'content-type': only }), 'content-type'.length + only.length, table === null ? null : only, table)
        table?.set(only, set)
      }
    } else {
      const bytes = headerBytes(headers, names)
      const signature = bytes <= INTERN_BYTES_LIMIT ? JSON.stringify(headers) : null
      set = signature === null ? undefined : this.#sets.get(signature)
      if (set === undefined) {
        const table = signature !== null && this.#sets.size < INTERNED_HEADER_SETS ? this.#sets : null
        set = new HeaderSet(frozenCopy(headers, names), bytes, table === null ? null : signature, table)
        if (table !== null) table.set(signature as string, set)
      }
    }
    set.refs++
    return set
  }

  /** One reference fewer: the last one takes the set out of its table, so the GC can free it. */
  release (set: HeaderSet): void {
    if (--set.refs > 0 || set.table === null) return
    if (set.table.get(set.signature as string) === set) set.table.delete(set.signature as string)
  }

  clear (): void {
    this.#sets.clear()
    this.#byContentType.clear()
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
