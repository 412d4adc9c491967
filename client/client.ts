import { runAttempt, type AttemptOutcome } from './attempt.js'
import { backoffDelay, retryAfterMs } from './backoff.js'
import { encodeBody, type RequestBody } from './body.js'
import { InvalidOptionError, NoAnswerError, ResponseTooLargeError } from './errors.js'
import { checkKey, generateKey, methodNeedsKey, serializeKey } from './key.js'
import { headerRecord, resolveClientOptions, type IdempotentClientOptions, type ResolvedClientOptions } from './options.js'
import { buildResponse, isReplay, type IdempotentResponse } from './response.js'
import { resolveUrl } from './url.js'

export interface RequestOptions {
  /** Sent the same on every attempt; a plain object, array, number, boolean or null is sent as JSON. */
  readonly body?: RequestBody
  readonly headers?: Readonly<Record<string, string>>
  /**
   * The operation's key, for resuming an operation whose outcome is unknown (`NoAnswerError.key`)
   * or a key kept with the operation in your own records. Without it, POST, PATCH and other
   * non-idempotent methods get a fresh UUID v4; GET, HEAD, OPTIONS, TRACE, PUT and DELETE get none.
   */
  readonly key?: string
  /** Cancels the operation: the attempt in flight and any wait; the call rejects with its reason. */
  readonly signal?: AbortSignal
}

type Call = (path: string | URL, options?: RequestOptions) => Promise<IdempotentResponse>

export interface IdempotentClient {
  /**
   * Sends one logical operation, retrying it with the same key on network errors, timeouts and
   * `retryStatuses` answers. Resolves with the final answer (whatever its status, a 3xx included);
   * rejects with `NoAnswerError` when no attempt got one, with `ResponseTooLargeError` when its body
   * exceeds `maxResponseBytes`, and with `InvalidOptionError` (nothing sent) for a path that
   * resolves outside `baseUrl`.
   */
  request (method: string, path: string | URL, options?: RequestOptions): Promise<IdempotentResponse>
  readonly post: Call
  readonly patch: Call
  readonly put: Call
  readonly delete: Call
  readonly get: Call
}

/**
 * A `fetch`-based client for APIs that honour `Idempotency-Key`
 * (draft-ietf-httpapi-idempotency-key-header): one key per logical operation, reused on every
 * retry, so an attempt whose answer was lost is replayed by the server, never executed twice.
 * Options are validated here, once.
 *
 * @example
 * const client = createIdempotentClient({ baseUrl: 'https://api.example.com', maxAttempts: 5 })
 * const result = await client.post('/payments', { body: { amount: 100 } })
 * if (result.ok) console.log(result.json(), result.replayed, result.attempts, result.key)
 */
export function createIdempotentClient (options: IdempotentClientOptions = {}): IdempotentClient {
  const resolved = resolveClientOptions(options)
  const request = (method: string, path: string | URL, requestOptions: RequestOptions = {}): Promise<IdempotentResponse> =>
    send(resolved, method, path, requestOptions)
  return {
    request,
    post: (path, requestOptions) => request('POST', path, requestOptions),
    patch: (path, requestOptions) => request('PATCH', path, requestOptions),
    put: (path, requestOptions) => request('PUT', path, requestOptions),
    delete: (path, requestOptions) => request('DELETE', path, requestOptions),
    get: (path, requestOptions) => request('GET', path, requestOptions)
  }
}

async function send (options: ResolvedClientOptions, rawMethod: string, path: string | URL, request: RequestOptions): Promise<IdempotentResponse> {
  const method = checkMethod(rawMethod)
  const url = resolveUrl(options.baseUrl, path)
  const signal = checkSignal(request.signal)
  // Generated before the first attempt and never again: every retry is the same operation (draft §2.2).
  const key = request.key !== undefined ? checkKey(request.key) : methodNeedsKey(method) ? generateKey() : null
  const init = requestInit(options, method, request, key)
  // Refuses a body on GET/HEAD and similar misuse now, rather than as a "network error" to retry.
  void new Request(url, init)

  const deadline = options.now() + options.deadlineMs
  let last: AttemptOutcome | undefined
  let attempts = 0
  for (;;) {
    signal?.throwIfAborted()
    const remaining = deadline - options.now()
    if (last !== undefined && remaining <= 0) return giveUp(last, 'deadline')
    attempts++
    const timeoutMs = Math.min(options.timeoutMs, Math.max(1, Math.ceil(remaining)))
    last = await runAttempt({ ...options, timeoutMs }, url, init, signal)
    let wait = backoffDelay(attempts, options.backoffBaseMs, options.backoffMaxMs, options.random)
    // An answer too large to read is still an answer: its status and headers decide, as for any other.
    if (last.kind !== 'failure') {
      const { status, headers } = last.response
      // A replayed answer is the operation's recorded outcome: asking again only replays it again.
      if (isReplay(headers) || !options.retryStatuses.has(status)) return giveUp(last, 'attempts')
      // Never sooner than the server asked (RFC 9110 §10.2.3); the jitter still spreads the herd.
      wait = Math.max(wait, retryAfterMs(headers) ?? 0)
    }
    if (attempts >= options.maxAttempts) return giveUp(last, 'attempts')
    if (options.now() + wait >= deadline) return giveUp(last, 'deadline')
    await options.sleep(wait, signal)
  }

  function giveUp (outcome: AttemptOutcome, reason: 'attempts' | 'deadline'): IdempotentResponse {
    if (outcome.kind === 'answer') return buildResponse(outcome.response, outcome.body, attempts, key)
    // Origin and path only: credentials or tokens in the userinfo or query stay out of error logs.
    const { origin, pathname } = new URL(url)
    const what = `${method} ${origin}${pathname}`
    if (outcome.kind === 'too-large') {
      const { response, declaredBytes, receivedBytes } = outcome
      throw new ResponseTooLargeError(what, {
        key,
        attempts,
        status: response.status,
        headers: response.headers,
        replayed: isReplay(response.headers),
        limit: options.maxResponseBytes,
        declaredBytes,
        receivedBytes
      })
    }
    throw new NoAnswerError(what, key, attempts, reason, outcome.error)
  }
}

function requestInit (options: ResolvedClientOptions, method: string, request: RequestOptions, key: string | null): RequestInit {
  const encoded = encodeBody(request.body)
  const headers: Record<string, string> = { ...options.headers, ...headerRecord('headers', request.headers) }
  if (encoded?.contentType != null && headers['content-type'] === undefined) headers['content-type'] = encoded.contentType
  if (key !== null) headers['idempotency-key'] = serializeKey(key)
  // The cast spans lib typings: with the DOM lib, BodyInit wants a Uint8Array over an ArrayBuffer only.
  return { method, headers, ...(encoded === null ? {} : { body: encoded.bytes as NonNullable<RequestInit['body']> }) }
}

function checkMethod (method: unknown): string {
  if (typeof method !== 'string' || !/^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/.test(method)) {
    throw new InvalidOptionError('method', 'an HTTP method token (RFC 9110 §9.1)', method)
  }
  // fetch upper-cases only the standard methods; doing it for all keeps methodNeedsKey simple.
  return method.toUpperCase()
}

function checkSignal (signal: unknown): AbortSignal | undefined {
  if (signal !== undefined && !(signal instanceof AbortSignal)) throw new InvalidOptionError('signal', 'an AbortSignal', signal)
  return signal
}
