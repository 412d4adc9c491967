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
 * Picks the replayable headers out of the response headers (names are already lower case). An
 * array is copied: the reply's own array stays the reply's, so a hook that later appends to it in
 * place (onSend, onResponse), or a handler that reuses a module-level array, cannot rewrite what
 * was recorded (issue 16, finding 2).
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
