import { StoreTimeoutError } from './errors.js'

/**
 * Bounds a store call: a store that hangs must turn into a store failure (503, or a logged bypass),
 * never into a request that waits forever. The call itself is not cancelled; a claim that lands
 * after its timeout is an orphan whose lease simply expires.
 */
export function withTimeout<T> (operation: string, ms: number, call: () => Promise<T>): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const timer = setTimeout(() => reject(new StoreTimeoutError(operation, ms)), ms)
    let pending: Promise<T>
    try {
      pending = call()
    } catch (err) {
      clearTimeout(timer)
      reject(err)
      return
    }
    pending.then(
      (value) => { clearTimeout(timer); resolve(value) },
      (err: unknown) => { clearTimeout(timer); reject(err) }
    )
  })
}
