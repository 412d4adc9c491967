import { StoreTimeoutError } from './errors.js'

/**
 * Bounds a store call: a store that hangs must turn into a store failure (503, or a logged bypass),
 * never into a request that waits forever. The call itself is not cancelled: `onLate` receives a
 * result that lands after the timeout (a claim acquired by then is released, so it is not left to
 * block retries until its lease expires, nor an atomic-mode transaction left open).
 */
export function withTimeout<T> (operation: string, ms: number, call: () => Promise<T>, onLate?: (value: T) => void): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    let timedOut = false
    const timer = setTimeout(() => { timedOut = true; reject(new StoreTimeoutError(operation, ms)) }, ms)
    let pending: Promise<T>
    try {
      pending = call()
    } catch (err) {
      clearTimeout(timer)
      reject(err)
      return
    }
    pending.then(
      (value) => {
        clearTimeout(timer)
        if (timedOut) onLate?.(value)
        else resolve(value)
      },
      (err: unknown) => { clearTimeout(timer); reject(err) }
    )
  })
}
