import type { FetchLike } from './options.js'
import { readBody } from './read-body.js'
import { MAX_REDIRECTS, nextHop, type Hop, type RedirectMode } from './redirect.js'

export type AttemptOutcome =
  | { readonly kind: 'answer', readonly response: Response, readonly body: Uint8Array }
  | {
    /** An answer whose body exceeded `maxResponseBytes`: its status and headers, not its body. */
    readonly kind: 'too-large'
    readonly response: Response
    readonly declaredBytes: number | null
    readonly receivedBytes: number
  }
  | { readonly kind: 'failure', readonly error: unknown }

export interface AttemptSettings {
  readonly fetch: FetchLike
  readonly timeoutMs: number
  readonly redirect: RedirectMode
  readonly maxResponseBytes: number
}

/**
 * One attempt: the request (and, with `redirect: 'same-origin'`, its same-origin redirects) and the
 * answer's body, within `timeoutMs`. A reset while the body streams in is as ambiguous as one before
 * the headers (the server may have committed), so both are failures the caller may retry. Only the
 * caller's own abort is thrown.
 */
export async function runAttempt (
  settings: AttemptSettings, url: string, init: RequestInit, callerSignal: AbortSignal | undefined
): Promise<AttemptOutcome> {
  const { fetch, timeoutMs } = settings
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
  const exchange = (async (): Promise<AttemptOutcome> => {
    let hop: Hop = { url, init }
    for (let redirects = 0; ; redirects++) {
      // 'manual' always: fetch's own following would take the body, the key and the credentials
      // to any origin (see redirect.ts); the client decides, hop by hop.
      const response = await fetch(hop.url, { ...hop.init, redirect: 'manual', signal: controller.signal })
      const next = settings.redirect === 'same-origin' && redirects < MAX_REDIRECTS ? nextHop(hop, response) : null
      if (next === null) {
        const read = await readBody(response, settings.maxResponseBytes)
        if (read.kind === 'whole') return { kind: 'answer', response, body: read.body }
        return { kind: 'too-large', response, declaredBytes: read.declaredBytes, receivedBytes: read.receivedBytes }
      }
      // A redirect's own body is never read; cancelling it lets the connection go.
      response.body?.cancel().catch(() => {})
      hop = next
    }
  })()
  // Whichever loses the race settles unobserved.
  exchange.catch(() => {})
  aborted.catch(() => {})
  try {
    return await Promise.race([exchange, aborted])
  } catch (error) {
    if (callerSignal?.aborted === true) throw callerSignal.reason
    return { kind: 'failure', error }
  } finally {
    clearTimeout(timer)
    callerSignal?.removeEventListener('abort', onCallerAbort)
    // Frees the connection of an attempt given up on (a body still streaming after the timeout, or
    // past maxResponseBytes).
    controller.abort()
  }
}
