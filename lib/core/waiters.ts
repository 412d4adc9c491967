import { createHash } from 'node:crypto'
import type { IdempotencyStore } from './store.js'

/**
 * Wake-ups for duplicates waiting on an in-flight original (the `wait` option). A key settled by
 * this process wakes its local waiters at once. A key settled by another process wakes them
 * through the store's settlement notices (IdempotencyStore.watchSettlements: one watch per
 * registration, opened at its first wait), while they flow; while they do not (a store without
 * them, a watch lost and not yet back), waiters poll the store.
 */
export class Waiters {
  /** Each followed id's followers, as the function that tells one of a notice. */
  readonly #waiting = new Map<string, Set<(settled: boolean) => void>>()
  /** The ids waited for, by settlement digest (what a notice names); kept only while a watch is open. */
  readonly #byDigest = new Map<string, string>()
  #store: IdempotencyStore | null = null
  #stopWatch: (() => void) | null = null
  #live = false
  #stopped = false

  /** `store`: where notices come from, or null (in-process wake-ups only). */
  constructor (store: IdempotencyStore | null = null) {
    this.#store = store?.watchSettlements === undefined ? null : store
  }

  /** True while the store's notices flow: a waiter may then sleep until it is woken (or its original's lease lapses) instead of polling. */
  get live (): boolean {
    return this.#live
  }

  /**
   * Opens the store's watch, once: at the first claim that duplicates may wait for, so that the
   * watch is usually in place by the time one does.
   */
  watch (): void {
    const store = this.#store
    if (store === null || this.#stopped) return
    this.#store = null
    const watch = store.watchSettlements as NonNullable<IdempotencyStore['watchSettlements']>
    let stop: () => void
    try {
      stop = watch.call(store, {
        settled: (digest) => {
          const id = this.#byDigest.get(digest)
          if (id !== undefined) this.notify(id)
        },
        live: (flowing) => {
          if (flowing === this.#live || this.#stopped) return
          this.#live = flowing
          // Either way every waiter reads its record once more: a notice may have been missed while
          // the watch was down, and a waiter sleeping on notices must start polling now.
          for (const id of [...this.#waiting.keys()]) this.notify(id, false)
        }
      })
    } catch {
      // A store that cannot watch after all: its waiters poll, as without the method.
      return
    }
    this.#stopWatch = stop
    // Keys already waited for are indexed now, so a first notice finds them.
    for (const id of this.#waiting.keys()) this.#byDigest.set(digestOf(id), id)
  }

  /**
   * A duplicate's interest in `id`, from before it asks the store until it stops waiting (`end`):
   * a settlement of `id` that comes while it is not waiting (between the store's answer and its
   * next wait) is kept for that wait, which then returns at once, so no notice falls between the
   * claim that found the key taken and the wait that follows it.
   */
  follow (id: string): Follower {
    let set = this.#waiting.get(id)
    if (set === undefined) {
      set = new Set()
      this.#waiting.set(id, set)
      if (this.#stopWatch !== null) this.#byDigest.set(digestOf(id), id)
    }
    const followers = set
    return new Follower(followers, (noticed) => {
      followers.delete(noticed)
      if (followers.size === 0 && this.#waiting.get(id) === followers) {
        this.#waiting.delete(id)
        if (this.#byDigest.size > 0) this.#byDigest.delete(digestOf(id))
      }
    })
  }

  /** `id` settled: its followers wake. `settled` false: they only read their record again (a watch came or went). */
  notify (id: string, settled = true): void {
    const set = this.#waiting.get(id)
    if (set === undefined) return
    for (const noticed of [...set]) noticed(settled)
  }

  /** Stops the watch (the registration or runner closed); waiters poll from then on. */
  stop (): void {
    this.#stopped = true
    this.#store = null
    this.#stopWatch?.()
    this.#stopWatch = null
    this.#live = false
    this.#byDigest.clear()
  }
}

/** The same length-prefixed (scope, key) identity the drivers use, for in-process maps. */
export function localId (scope: string, key: string): string {
  return `${scope.length}:${scope}${key}`
}

/**
 * What a settlement notice carries for the record (scope, key) (IdempotencyStore.watchSettlements):
 * a digest of its identity, 43 characters, so a notice never shows a key.
 */
export function settlementDigest (scope: string, key: string): string {
  return digestOf(localId(scope, key))
}

function digestOf (id: string): string {
  return createHash('sha256').update(id).digest('base64url')
}

/** One duplicate's interest in a key (Waiters.follow). */
export class Follower {
  /** What came while it was not waiting: a settlement (true), a watch that came or went (false), or nothing (null). */
  #noticed: boolean | null = null
  #wake: ((settled: boolean) => void) | null = null
  #timer: ReturnType<typeof setTimeout> | undefined
  readonly #noticedBy: (settled: boolean) => void
  readonly #unfollow: (noticedBy: (settled: boolean) => void) => void

  constructor (followers: Set<(settled: boolean) => void>, unfollow: (noticedBy: (settled: boolean) => void) => void) {
    this.#noticedBy = (settled) => {
      const wake = this.#wake
      if (wake === null) {
        this.#noticed = this.#noticed === true || settled
        return
      }
      this.#wake = null
      clearTimeout(this.#timer)
      wake(settled)
    }
    this.#unfollow = unfollow
    followers.add(this.#noticedBy)
  }

  /**
   * Resolves when the key is settled (here, or anywhere while notices flow) or after `ms`, whichever
   * comes first: true when woken by a settlement, false when the time ran out. At once when a
   * notice came since the last wait.
   */
  wait (ms: number): Promise<boolean> {
    const noticed = this.#noticed
    if (noticed !== null) {
      this.#noticed = null
      return Promise.resolve(noticed)
    }
    return new Promise((resolve) => {
      this.#wake = resolve
      this.#timer = setTimeout(() => {
        this.#wake = null
        resolve(false)
      }, ms)
    })
  }

  /** Stops following: nothing more is kept for it. */
  end (): void {
    clearTimeout(this.#timer)
    this.#wake = null
    this.#unfollow(this.#noticedBy)
  }
}
