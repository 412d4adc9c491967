import { StoreTimeoutError } from './errors.js'
import { schedules, type Scheduled } from './schedule.js'
import type { Answer } from './store.js'
import { isThenable } from './thenable.js'

/** A store call in flight, waiting in the schedule of its bound (lib/core/schedule.ts). */
class Pending<T> implements Scheduled {
  dueAt = 0
  previous: Scheduled | null = null
  next: Scheduled | null = null
  scheduled = false
  timedOut = false

  constructor (
    readonly operation: string,
    readonly ms: number,
    readonly resolve: (value: T) => void,
    readonly reject: (error: unknown) => void,
    readonly onLate: ((value: T) => void) | undefined
  ) {}

  settle (value: T): void {
    if (this.timedOut) {
      this.onLate?.(value)
      return
    }
    scheduleFor(this.ms).remove(this)
    this.resolve(value)
  }

  fail (error: unknown): void {
    if (this.timedOut) return
    scheduleFor(this.ms).remove(this)
    this.reject(error)
  }
}

const scheduleFor = schedules<Pending<any>>((pending) => {
  pending.timedOut = true
  pending.reject(new StoreTimeoutError(pending.operation, pending.ms))
}, true)

/**
 * Calls a store operation and bounds it: a store that hangs must turn into a store failure (503, or
 * a logged bypass), never into a request that waits forever. An answer given directly (not a
 * thenable: the memory store's) is returned as it is, with nothing to bound; an operation that
 * throws rejects, as if its promise had. The call itself is not cancelled: `onLate` receives a
 * result that lands after the timeout (a claim acquired by then is given back, so it neither
 * blocks retries until its lease expires nor leaves an atomic-mode transaction open).
 */
export function bounded<T> (operation: string, ms: number, call: () => Answer<T>, onLate?: (value: T) => void): T | Promise<T> {
  let answer: Answer<T>
  try {
    answer = call()
  } catch (err) {
    return Promise.reject(err)
  }
  return isThenable(answer) ? boundedPromise(operation, ms, answer, onLate) : answer
}

/** `bounded` for an answer already in hand that is a promise. */
export function boundedPromise<T> (operation: string, ms: number, promise: PromiseLike<T>, onLate?: (value: T) => void): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const pending = new Pending<T>(operation, ms, resolve, reject, onLate)
    scheduleFor(ms).add(pending)
    promise.then((value) => { pending.settle(value) }, (err: unknown) => { pending.fail(err) })
  })
}
