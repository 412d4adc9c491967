import { StoreTimeoutError } from './errors.js'
import { schedules, type Scheduled } from './schedule.js'

/** A store call in flight, waiting in the schedule of its bound (lib/schedule.ts). */
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
 * Bounds a store call: a store that hangs must turn into a store failure (503, or a logged bypass),
 * never into a request that waits forever. The call itself is not cancelled: `onLate` receives a
 * result that lands after the timeout (a claim acquired by then is released, so it is not left to
 * block retries until its lease expires, nor an atomic-mode transaction left open).
 */
export function withTimeout<T> (operation: string, ms: number, call: () => Promise<T>, onLate?: (value: T) => void): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const pending = new Pending<T>(operation, ms, resolve, reject, onLate)
    let result: Promise<T>
    try {
      result = call()
    } catch (err) {
      reject(err)
      return
    }
    scheduleFor(ms).add(pending)
    result.then((value) => { pending.settle(value) }, (err: unknown) => { pending.fail(err) })
  })
}
