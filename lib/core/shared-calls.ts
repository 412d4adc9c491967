/**
 * The store calls of duplicates that wait (the `wait` option), shared within one process: a claim
 * or read of a key that another waiting duplicate of the same key has in flight is not sent again;
 * its answer is taken instead. A storm of duplicates then costs the store one call per process and
 * key at a time, not one per duplicate: one claim when they arrive, one read when the original
 * settles. Only an answer about the record is shared (in progress, completed, what a read found);
 * a claim that acquired the key is its asker's alone, and whoever joined it asks again.
 */
import type { Answer } from './store.js'

export class SharedCalls {
  readonly #inFlight = new Map<string, Promise<unknown>>()

  /**
   * `call`'s answer, or the one already in flight under `name`. `own` says which: false when the
   * answer came from another caller's call (which that caller owns: a late answer, a claim that
   * acquired, are its to deal with). `call` must settle within its caller's bound (its
   * storeTimeout): a store call that is never answered would otherwise be joined for good.
   */
  run<T> (name: string, call: () => Answer<T>): { readonly answer: Promise<T>, readonly own: boolean } {
    const inFlight = this.#inFlight.get(name) as Promise<T> | undefined
    if (inFlight !== undefined) return { answer: inFlight, own: false }
    let answer: Promise<T>
    try {
      answer = Promise.resolve(call())
    } catch (err) {
      answer = Promise.reject(err)
    }
    this.#inFlight.set(name, answer)
    const done = (): void => { if (this.#inFlight.get(name) === answer) this.#inFlight.delete(name) }
    answer.then(done, done)
    return { answer, own: true }
  }
}
