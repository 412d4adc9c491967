import type { FetchLike } from './options.js'

export type AttemptOutcome =
  | { readonly kind: 'answer', readonly response: Response, readonly body: Uint8Array }
  | { readonly kind: 'failure', readonly error: unknown }

/**
 * One attempt: the request and its whole response body, within `timeoutMs`. A reset while the body
 * streams in is as ambiguous as one before the headers (the server may have committed), so both are
 * failures the caller may retry. Only the caller's own abort is thrown.
 */
export async function runAttempt (
  fetch: FetchLike, url: string, init: RequestInit, timeoutMs: number, callerSignal: AbortSignal | undefined
): Promise<AttemptOutcome> {
  callerSignal?.throwIfAborted()
  const controller = new AbortController()
  const onCallerAbort = (): void => { controller.abort(callerSignal?.reason) }
  callerSignal?.addEventListener('abort', onCallerAbort, { once: true })
  const timer = setTimeout(() => {
    controller.abort(new DOMException(`the attempt timed out after ${timeoutMs} ms`, 'TimeoutError'))
  }, timeoutMs)
  // The race keeps an injected fetch that ignores its signal from holding the attempt past its timeout.
  const aborted = new Promise<never>((_resolve, reject) => {
    controller.signal.addEventListener('abort', () => { reject(controller.signal.reason) }, { once: true })
  })
  const exchange = (async () => {
    const response = await fetch(url, { ...init, signal: controller.signal })
    return { response, body: new Uint8Array(await response.arrayBuffer()) }
  })()
  // Whichever loses the race settles unobserved.
  exchange.catch(() => {})
  aborted.catch(() => {})
  try {
    const { response, body } = await Promise.race([exchange, aborted])
    return { kind: 'answer', response, body }
  } catch (error) {
    if (callerSignal?.aborted === true) throw callerSignal.reason
    return { kind: 'failure', error }
  } finally {
    clearTimeout(timer)
    callerSignal?.removeEventListener('abort', onCallerAbort)
    // Frees the connection of an attempt given up on (a body still streaming after the timeout).
    controller.abort()
  }
}
