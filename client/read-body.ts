export type BodyRead =
  | { readonly kind: 'whole', readonly body: Uint8Array }
  | {
    readonly kind: 'too-large'
    /** The `Content-Length` that announced the excess, or `null` when counting found it. */
    readonly declaredBytes: number | null
    /** Bytes read before the read was given up: 0 when `Content-Length` said enough. */
    readonly receivedBytes: number
  }

/**
 * The response body, read as a stream and given up past `limit` bytes, so that no answer can make
 * the client hold more than the limit plus one chunk. A `Content-Length` over the limit is refused
 * before any byte is read; a chunked (or understated) body is counted while it arrives. Giving up
 * cancels the stream; the caller's abort then closes the connection (undici destroys the socket).
 */
export async function readBody (response: Response, limit: number): Promise<BodyRead> {
  const stream = response.body
  // HEAD, 204 and 304 have no body, whatever their Content-Length says (RFC 9110 §8.6).
  if (stream === null) return { kind: 'whole', body: new Uint8Array(0) }
  const declaredBytes = declaredLength(response.headers)
  if (declaredBytes !== null && declaredBytes > limit) {
    stream.cancel().catch(() => {})
    return { kind: 'too-large', declaredBytes, receivedBytes: 0 }
  }
  const reader = stream.getReader()
  const chunks: Uint8Array[] = []
  let receivedBytes = 0
  for (;;) {
    const { done, value } = await reader.read()
    if (done) break
    receivedBytes += value.byteLength
    if (receivedBytes > limit) {
      reader.cancel().catch(() => {})
      return { kind: 'too-large', declaredBytes, receivedBytes }
    }
    chunks.push(value)
  }
  return { kind: 'whole', body: concat(chunks, receivedBytes) }
}

/**
 * `Content-Length` as a byte count of what the reader will see, or `null`. With a `Content-Encoding`
 * it counts the coded bytes, not the decoded ones `fetch` hands over, so only counting can tell.
 */
function declaredLength (headers: Headers): number | null {
  const coding = headers.get('content-encoding')?.trim().toLowerCase()
  if (coding !== undefined && coding !== '' && coding !== 'identity') return null
  const value = headers.get('content-length')?.trim()
  return value !== undefined && /^\d{1,16}$/.test(value) ? Number(value) : null
}

/** One copy into a buffer of its own: a chunk may be a view into a larger one the reader reuses. */
function concat (chunks: readonly Uint8Array[], length: number): Uint8Array {
  const body = new Uint8Array(length)
  let offset = 0
  for (const chunk of chunks) {
    body.set(chunk, offset)
    offset += chunk.byteLength
  }
  return body
}
