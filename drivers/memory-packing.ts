/**
 * Compact storage of completed records for the memory store. A million records is the target
 * scale, and per-record overhead dominates small bodies: every Buffer with its own memory costs a
 * few hundred bytes of bookkeeping on top of its bytes, and every copied headers object another
 * hundred. So a completed record keeps its fingerprint digest and body as one view into a shared
 * slab, and identical header sets share one frozen object.
 */

/** Records larger than this get memory of their own, so a large body never pins a slab. */
const SLAB_RECORD_LIMIT = 8 * 1024
const SLAB_SIZE = 256 * 1024
const INTERNED_HEADER_SETS = 1024

export class Slabs {
  #slab = Buffer.allocUnsafeSlow(SLAB_SIZE)
  #offset = 0
  #last: Buffer = this.#slab

  /** The buffer the last `pack` wrote to (a slab, or a large record's own). */
  get last (): Buffer { return this.#last }

  /**
   * Copies `first` then `second` into fresh memory and returns their offset in `last`. Small
   * records share slabs: records written together expire together (one ttl), so a slab is freed by
   * the GC soon after its last record goes, and copying never aliases the caller's (possibly
   * pooled) buffers. The caller keeps (buffer, offset, length) rather than a view: a view is an
   * object of its own per record.
   */
  pack (first: Buffer, second: Buffer | null): number {
    const length = first.length + (second?.length ?? 0)
    let target: Buffer
    let offset: number
    if (length > SLAB_RECORD_LIMIT) {
      target = Buffer.allocUnsafeSlow(length)
      offset = 0
    } else {
      if (this.#offset + length > SLAB_SIZE) {
        this.#slab = Buffer.allocUnsafeSlow(SLAB_SIZE)
        this.#offset = 0
      }
      target = this.#slab
      offset = this.#offset
      // 8-byte alignment keeps views cheap to create and compare.
      this.#offset += (length + 7) & ~7
    }
    // TypedArray#set: a builtin, cheaper per call than Buffer#copy for these small copies.
    target.set(first, offset)
    if (second !== null) target.set(second, offset + first.length)
    this.#last = target
    return offset
  }
}

type Headers = Readonly<Record<string, string | string[]>>

/** Frozen header sets shared between records; bounded, so hostile variety cannot grow it. */
export class HeaderSets {
  readonly #sets = new Map<string, Headers>()

  /** The sets that hold one Content-Type alone (nearly every response), by its value: no signature to build. */
  readonly #byContentType = new Map<string, Headers>()

  intern (headers: Headers): Headers {
    const names = Object.keys(headers)
    const only = names.length === 1 && names[0] === 'content-type' ? headers['content-type'] : undefined
    if (typeof only === 'string') {
      const known = this.#byContentType.get(only)
      if (known !== undefined) return known
      const frozen = Object.freeze({ 'content-type': only })
      if (this.#byContentType.size < INTERNED_HEADER_SETS) this.#byContentType.set(only, frozen)
      return frozen
    }
    const signature = JSON.stringify(headers)
    const known = this.#sets.get(signature)
    if (known !== undefined) return known
    const frozen = Object.freeze({ ...headers })
    if (this.#sets.size < INTERNED_HEADER_SETS) this.#sets.set(signature, frozen)
    return frozen
  }

  clear (): void {
    this.#sets.clear()
    this.#byContentType.clear()
  }
}
