/**
 * The memory store's records by (scope, key): a map of scopes, each a map of keys. A million
 * records is the target scale, and a key built from both (`${scope.length}:${scope}${key}`) was a
 * string of its own per record, a rope of three that V8 flattened on every lookup, on top of the
 * key it was built from. Scopes are few and shared; the key is kept once, as a compact copy (the
 * parser hands keys over as slices of the header's string, which would keep that string alive too).
 */

export interface Keyed {
  readonly scope: string
  readonly key: string
}

/** Latin-1 text (every key the plugin accepts is ASCII) is copied into a string of its own. */
const LATIN1 = /^[\x00-\xff]*$/

export function compactKey (key: string): string {
  return LATIN1.test(key) ? Buffer.from(key, 'latin1').toString('latin1') : key
}

export class Records<E extends Keyed> {
  readonly #scopes = new Map<string, Map<string, E>>()
  #size = 0

  get size (): number { return this.#size }

  get (scope: string, key: string): E | undefined {
    return this.#scopes.get(scope)?.get(key)
  }

  /** Adds `entry`, which must not be there yet. */
  add (entry: E): void {
    let keys = this.#scopes.get(entry.scope)
    if (keys === undefined) {
      keys = new Map()
      this.#scopes.set(entry.scope, keys)
    }
    keys.set(entry.key, entry)
    this.#size++
  }

  delete (entry: E): void {
    const keys = this.#scopes.get(entry.scope)
    if (keys === undefined || keys.get(entry.key) !== entry) return
    keys.delete(entry.key)
    this.#size--
    // A scope's map goes with its last record: scopes come and go (tenants), they must not pile up.
    if (keys.size === 0) this.#scopes.delete(entry.scope)
  }

  /** Every record; deleting records meanwhile is safe (Map iteration skips what was deleted). */
  * [Symbol.iterator] (): IterableIterator<E> {
    for (const keys of this.#scopes.values()) yield * keys.values()
  }

  clear (): void {
    this.#scopes.clear()
    this.#size = 0
  }
}
