import { Readable } from 'node:stream'
import type { ReadableStream as WebReadableStream } from 'node:stream/web'
import type { FastifyReply } from 'fastify'

/**
 * What `onSend` can carry in Fastify 5 (after serialisation): a string, a Buffer, a Node stream, a
 * web ReadableStream, a fetch Response, or null/undefined for no body.
 */
export type CapturedPayload =
  | { readonly kind: 'bytes', readonly body: Buffer }
  | { readonly kind: 'stream', readonly source: Readable }
  | { readonly kind: 'unsupported' }

const EMPTY = Buffer.alloc(0)
const toString = Object.prototype.toString

export function isFetchResponse (payload: unknown): payload is Response {
  return payload !== null && typeof payload === 'object' && toString.call(payload) === '[object Response]'
}

/**
 * Classifies the payload. A fetch Response has its status and headers applied to the reply here
 * (Fastify would only do so after onSend), so that what is recorded is what is sent.
 */
export function classifyPayload (payload: unknown, reply: FastifyReply): CapturedPayload {
  if (typeof payload === 'string') return { kind: 'bytes', body: Buffer.from(payload) }
  if (Buffer.isBuffer(payload)) return { kind: 'bytes', body: payload }
  if (payload === null || payload === undefined) return { kind: 'bytes', body: EMPTY }
  if (isFetchResponse(payload)) {
    reply.code(payload.status)
    for (const [name, value] of payload.headers) reply.header(name, value)
    return payload.body === null
      ? { kind: 'bytes', body: EMPTY }
      : { kind: 'stream', source: Readable.fromWeb(payload.body as WebReadableStream<Uint8Array>) }
  }
  if (typeof (payload as Readable).pipe === 'function') return { kind: 'stream', source: payload as Readable }
  if (typeof (payload as WebReadableStream).getReader === 'function') {
    return { kind: 'stream', source: Readable.fromWeb(payload as WebReadableStream<Uint8Array>) }
  }
  return { kind: 'unsupported' }
}

export interface StreamCaptureEvents {
  /** The source ended: its bytes, or null when they exceeded the limit. The end of the response waits for it. */
  readonly onEnd: (body: Buffer | null) => Promise<void>
  /** The source failed before its end. */
  readonly onError: (error: Error) => Promise<void>
}

/**
 * Forwards a streamed body to the client while keeping a copy (up to `limit` bytes). The last byte
 * is released only after `onEnd` has recorded the body, so a client that saw the whole response can
 * rely on a retry replaying it. If the client goes away mid-stream, the source is still read to its
 * end: the handler's effect happened, and its outcome must be recorded, not lost. Once the body is
 * known to exceed `limit` with nobody left to send it to, reading more changes nothing (the outcome
 * is "completed, not retained"): the source is destroyed and that outcome recorded at once, so an
 * endless stream cannot hold its key forever.
 */
export function captureStream (source: Readable, limit: number, events: StreamCaptureEvents): Readable {
  const chunks: Buffer[] = []
  let size = 0
  let overflow = false
  let consumerGone = false
  let finished = false
  let held: Buffer | null = null

  const finish = (settle: () => Promise<void>, after: () => void): void => {
    if (finished) return
    finished = true
    settle().then(after, after)
  }

  // Nothing more is needed to record "not retained": stop reading an oversized body.
  const abandonOversized = (): void => { finish(() => events.onEnd(null), () => source.destroy()) }

  const out = new Readable({
    read () {
      source.resume()
    },
    destroy (error, callback) {
      consumerGone = true
      if (!finished) {
        if (overflow) abandonOversized()
        else source.resume()
      }
      callback(error)
    }
  })

  source.on('data', (chunk: Buffer | string) => {
    const bytes = typeof chunk === 'string' ? Buffer.from(chunk) : chunk
    size += bytes.length
    if (!overflow) {
      if (size > limit) {
        overflow = true
        chunks.length = 0
      } else {
        chunks.push(bytes)
      }
    }
    if (consumerGone) {
      if (overflow) abandonOversized()
      return
    }
    if (bytes.length === 0) return
    // The last byte seen so far is held back: the response cannot look complete to the client
    // (even with a Content-Length) before onEnd has recorded it.
    const previous = held
    held = bytes.subarray(bytes.length - 1)
    let more = previous === null || out.push(previous)
    if (bytes.length > 1) more = out.push(bytes.subarray(0, bytes.length - 1)) && more
    if (!more) source.pause()
  })
  source.once('end', () => {
    finish(() => events.onEnd(overflow ? null : Buffer.concat(chunks, size)), () => {
      if (consumerGone) return
      if (held !== null) out.push(held)
      out.push(null)
    })
  })
  source.once('error', (error: Error) => {
    finish(() => events.onError(error), () => out.destroy(error))
  })
  source.once('close', () => {
    // Destroyed without an error and before its end: the body is incomplete.
    const error = new Error('the response stream closed before its end')
    finish(() => events.onError(error), () => out.destroy(error))
  })
  return out
}
