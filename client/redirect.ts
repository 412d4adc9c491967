/**
 * What the client does with a 3xx answer:
 * - `'manual'`: nothing; the 3xx is the answer, returned to the caller with its `Location`.
 * - `'same-origin'`: a 301, 302, 303, 307 or 308 whose `Location` has the request's origin is
 *   followed (at most `MAX_REDIRECTS` hops); one to another origin is returned as the answer.
 *
 * Never `fetch`'s own `'follow'`: it re-sends the body (307/308), the `Idempotency-Key` and every
 * custom credential header (`x-api-key`; it strips only `Authorization`) to whatever origin the
 * `Location` names, and a 303 becomes a GET that still carries the key and the credentials.
 */
export type RedirectMode = 'manual' | 'same-origin'

/** Hops one attempt follows before it returns the last 3xx as the answer. */
export const MAX_REDIRECTS = 5

export interface Hop {
  readonly url: string
  readonly init: RequestInit
}

/** The statuses fetch follows (Fetch Standard, "redirect status"); 300 and 304 are answers. */
const REDIRECT_STATUSES = new Set([301, 302, 303, 307, 308])

/**
 * Request headers that describe the body (Fetch Standard, "request-body-header name"): dropped with
 * the body when a redirect turns the request into a GET.
 */
const BODY_HEADERS = ['content-type', 'content-encoding', 'content-language', 'content-location']

/**
 * The request that follows `response`, or `null` when it is the answer: not a redirect, no usable
 * `Location`, another origin, or credentials in the URL (`fetch` would refuse them, and a refusal
 * would be retried as if it were a network error).
 */
export function nextHop (current: Hop, response: Response): Hop | null {
  if (!REDIRECT_STATUSES.has(response.status)) return null
  const location = response.headers.get('location')
  if (location === null || !URL.canParse(location, current.url)) return null
  const next = new URL(location, current.url)
  if (next.origin !== new URL(current.url).origin || next.username !== '' || next.password !== '') return null
  next.hash = ''
  return { url: next.href, init: redirectedInit(current.init, response.status) }
}

/**
 * Fetch Standard, HTTP-redirect fetch step 12: a 303 (other than to a HEAD), and a 301 or 302 to a
 * POST, become a GET without a body. The `Idempotency-Key` goes with the body: it names the
 * operation that was redirected, not the GET that reads its result, and draft §2.2 forbids reusing
 * a key for a request with another payload. A 307 or 308 repeats the request as it was: the same
 * operation, key included.
 */
function redirectedInit (init: RequestInit, status: number): RequestInit {
  const method = init.method ?? 'GET'
  const toGet = (status === 303 && method !== 'GET' && method !== 'HEAD') || ((status === 301 || status === 302) && method === 'POST')
  if (!toGet) return init
  const headers = new Headers(init.headers)
  for (const name of [...BODY_HEADERS, 'idempotency-key']) headers.delete(name)
  return { ...init, method: 'GET', headers, body: null }
}
