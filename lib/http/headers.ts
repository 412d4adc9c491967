/**
 * Response headers replayed by default: the ones that describe the representation or the created
 * resource, so a replay means the same thing as the original.
 */
export const DEFAULT_REPLAY_HEADERS: readonly string[] = [
  'content-type',
  'content-language',
  'content-encoding',
  'content-disposition',
  'location',
  'etag',
  'last-modified',
  'link'
]

/**
 * Never recorded, whatever the option says: per-connection and hop-by-hop fields (RFC 9110 §7.6.1),
 * fields the server recomputes for every message (Date, Content-Length, RFC 9110 §6.6.1, §8.6), and
 * Set-Cookie, which would hand one client's session to whoever replays the key.
 */
export const NEVER_REPLAYED: ReadonlySet<string> = new Set([
  'connection',
  'keep-alive',
  'proxy-connection',
  'proxy-authenticate',
  'proxy-authorization',
  'te',
  'trailer',
  'transfer-encoding',
  'upgrade',
  'content-length',
  'date',
  'set-cookie',
  'idempotent-replayed'
])

/**
 * Refused in `replayHeaders`: a recorded header goes to whoever replays the
 * key, so these would hand one client's credentials or session to another, or replay a policy the
 * server computes per request, per origin and per moment as if it still held. `unsafeReplayHeaders`
 * forces one by name, for an app that knows its value is the same for every caller of the key.
 * - credentials and challenges: Authorization, WWW-Authenticate and Authentication-Info (RFC 9110
 *   §11.6.1-11.6.3), and their proxy twins (§11.7);
 * - sessions: Cookie, Cookie2 and Set-Cookie2 (RFC 6265, RFC 2965; Set-Cookie itself is never replayed);
 * - security policy: Strict-Transport-Security (RFC 6797), Content-Security-Policy (and its
 *   report-only twin), Clear-Site-Data, Alt-Svc (RFC 7838), Public-Key-Pins, Expect-CT,
 *   Permissions-Policy, the Cross-Origin-*-Policy headers, X-Frame-Options, Referrer-Policy, and the
 *   CORS response headers, every `Access-Control-*` (Fetch §3.2.3: computed for the request's Origin;
 *   @fastify/cors adds them to replays itself).
 */
export const SENSITIVE_HEADERS: ReadonlySet<string> = new Set([
  'authorization',
  'www-authenticate',
  'authentication-info',
  'proxy-authentication-info',
  'cookie',
  'cookie2',
  'set-cookie2',
  'strict-transport-security',
  'content-security-policy',
  'content-security-policy-report-only',
  'clear-site-data',
  'alt-svc',
  'public-key-pins',
  'public-key-pins-report-only',
  'expect-ct',
  'permissions-policy',
  'feature-policy',
  'cross-origin-opener-policy',
  'cross-origin-opener-policy-report-only',
  'cross-origin-embedder-policy',
  'cross-origin-embedder-policy-report-only',
  'cross-origin-resource-policy',
  'x-frame-options',
  'referrer-policy',
  'timing-allow-origin'
])
const SENSITIVE_PREFIXES = ['access-control-'] as const

/** A credential, cookie or security-policy header (lower-case name): see SENSITIVE_HEADERS. */
export function isSensitiveHeader (name: string): boolean {
  return SENSITIVE_HEADERS.has(name) || SENSITIVE_PREFIXES.some((prefix) => name.startsWith(prefix))
}

/**
 * Picks the replayable headers out of the response headers (names are already lower case). An
 * array is copied: the reply's own array stays the reply's, so a hook that later appends to it in
 * place (onSend, onResponse), or a handler that reuses a module-level array, cannot rewrite what
 * was recorded.
 */
export function pickReplayHeaders (
  headers: Readonly<Record<string, string | number | string[] | undefined>>,
  replayable: ReadonlySet<string>
): Record<string, string | string[]> {
  const picked: Record<string, string | string[]> = {}
  for (const name of replayable) {
    const value = headers[name]
    if (value === undefined) continue
    picked[name] = typeof value === 'number' ? String(value) : Array.isArray(value) ? [...value] : value
  }
  return picked
}

/**
 * A recorded header value as handed to a reply: Fastify keeps the value it is given, and the reply's
 * hooks may mutate it in place, so an array gets a copy of its own. A store's record (or a header
 * set the memory store shares between records, across scopes) is never what a reply holds.
 */
export function replyValue (value: string | readonly string[]): string | string[] {
  return typeof value === 'string' ? value : [...value]
}
