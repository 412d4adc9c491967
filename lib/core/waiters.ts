import { createHash } from 'node:crypto'
import type { IdempotencyStore } from './store.js'

/** What can tell of settlements in other processes: the store, the pre-filter. */
type Watchable = Pick<IdempotencyStore, 'watchSettlements'>

/**
 * Wake-ups for duplicates waiting on an in-flight original (the `wait` option). A key settled by
 * this process wakes its local waiters at once. A key settled by another process wakes them
 * through settlement notices (`watchSettlements`: the store's, and the pre-filter's; one watch each
 * per registration, opened at its first wait), while any of them flows; while none does (no source
 * has them, every watch lost and not back yet), waiters poll the store.
 */
export class Waiters {
  /** Each followed id's followers, as the function that tells one of a notice. */
  readonly #waiting = new Map<string, Set<(settled: boolean) => void>>()
  /** The ids waited for, by settlement digest (what a notice names); kept only while a watch is open. */
  readonly #byDigest = new Map<string, string>()
  #sources: Watchable[]
  readonly #stopWatches: Array<() => void> = []
  /** The sources whose notices flow now. */
  readonly #flowing = new Set<Watchable>()
  #stopped = false

  /** `sources`: where notices come from (the store, the pre-filter); none: in-process wake-ups only. */
  constructor (...sources: ReadonlyArray<Watchable | null>) {
    this.#sources = sources.filter((source): source is Watchable => source?.watchSettlements !== undefined)
  }

  /** True while notices flow: a waiter may then sleep until it is woken (or its original's lease lapses) instead of polling. */
  get live (): boolean {
    return this.#flowing.size > 0
  }

  /**
   * Opens the watches, once: at the first claim that duplicates may wait for, so that they are
   * usually in place by the time one does.
   */
  watch (): void {
    const sources = this.#sources
    if (sources.length === 0 || this.#stopped) return
    this.#sources = []
    for (const source of sources) this.#watch(source)
    // Keys already waited for are indexed now, so a first notice finds them.
    if (this.#stopWatches.length > 0) for (const id of this.#waiting.keys()) this.#byDigest.set(digestOf(id), id)
  }

  #watch (source: Watchable): void {
    const watch = source.watchSettlements as NonNullable<Watchable['watchSettlements']>
    try {
      this.#stopWatches.push(watch.call(source, {
        settled: (digest) => {
          const id = this.#byDigest.get(digest)
          if (id !== undefined) this.notify(id)
        },
        live: (flowing) => {
          if (flowing === this.#flowing.has(source) || this.#stopped) return
          const wasLive = this.live
          if (flowing) this.#flowing.add(source)
          else this.#flowing.delete(source)
          // Either way every waiter reads its record once more: a notice may have been missed while
          // the watch was down, and a waiter sleeping on notices must start polling now.
          if (this.live !== wasLive) for (const id of [...this.#waiting.keys()]) this.notify(id, false)
        }
      }))
    } catch {
      // A source that cannot watch after all: its notices never come, as without the method.
    }
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
      if (this.#stopWatches.length > 0) this.#byDigest.set(digestOf(id), id)
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

  /** Stops the watches (the registration or runner closed); waiters poll from then on. */
  stop (): void {
    this.#stopped = true
    this.#sources = []
    for (const stop of this.#stopWatches.splice(0)) stop()
    this.#flowing.clear()
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
