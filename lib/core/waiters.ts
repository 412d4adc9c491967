/**
 * In-process wake-ups for duplicates waiting on an in-flight original (the `wait` option). A key
 * completed or released by this process wakes its local waiters at once; waiters on an original
 * running in another process fall back to polling the store.
 */
export class Waiters {
  readonly #waiting = new Map<string, Set<() => void>>()

  /** Resolves when `id` is settled in this process or after `ms`, whichever comes first. */
  wait (id: string, ms: number): Promise<void> {
    return new Promise((resolve) => {
      let set = this.#waiting.get(id)
      if (set === undefined) {
        set = new Set()
        this.#waiting.set(id, set)
      }
      const waiting = set
      const wake = (): void => {
        clearTimeout(timer)
        waiting.delete(wake)
        if (waiting.size === 0 && this.#waiting.get(id) === waiting) this.#waiting.delete(id)
        resolve()
      }
      const timer = setTimeout(wake, ms)
      waiting.add(wake)
    })
  }

  notify (id: string): void {
    const set = this.#waiting.get(id)
    if (set === undefined) return
    for (const wake of [...set]) wake()
  }
}

/** The same length-prefixed (scope, key) identity the drivers use, for in-process maps. */
export function localId (scope: string, key: string): string {
  return `${scope.length}:${scope}${key}`
}
