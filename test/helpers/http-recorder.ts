import { createServer, type IncomingMessage, type ServerResponse } from 'node:http'
import type { Test } from 'tap'
import type { FetchLike } from '../../client/index.js'

/*
 * Real HTTP servers on loopback for the client's security tests: each records every request it
 * receives (so "nothing was sent there" is a count), and can stream large answers; a fetch that
 * counts the response bytes the client actually takes.
 */

export interface Received {
  readonly method: string
  readonly url: string
  readonly headers: IncomingMessage['headers']
  readonly body: string
}

export interface TestServer {
  readonly port: number
  readonly origin: string
  /** Every request received, in arrival order, body included. */
  readonly received: Received[]
}

export type Handler = (request: Received, response: ServerResponse) => void

/** A node:http server on 127.0.0.1, port 0; `handler` answers once the request body has arrived. */
export async function serve (t: Test, handler: Handler): Promise<TestServer> {
  const received: Received[] = []
  const server = createServer((request, response) => {
    // A client that gives up on an answer resets the connection: not an error here.
    request.socket.on('error', () => {})
    const chunks: Buffer[] = []
    request.on('data', (chunk: Buffer) => { chunks.push(chunk) })
    request.on('end', () => {
      const seen = { method: request.method ?? '', url: request.url ?? '', headers: request.headers, body: Buffer.concat(chunks).toString('utf8') }
      received.push(seen)
      handler(seen, response)
    })
  })
  await new Promise<void>((resolve) => { server.listen(0, '127.0.0.1', resolve) })
  t.teardown(() => new Promise<void>((resolve) => { server.closeAllConnections(); server.close(() => { resolve() }) }))
  const address = server.address()
  const port = typeof address === 'object' && address !== null ? address.port : 0
  return { port, origin: `http://127.0.0.1:${port}`, received }
}

/** Another origin that answers everything with 200: it must never hear from the client. */
export const bystander = (t: Test): Promise<TestServer> => serve(t, (_request, response) => { response.end('stolen') })

export interface Pulled { bytes: number, largestChunk: number, cancelled: boolean }

/**
 * The global fetch, with each response body handed over through a pull-only stream that counts what
 * the client actually took: bytes, the largest chunk, whether it cancelled the rest.
 */
export function countingFetch (): { fetch: FetchLike, pulled: Pulled } {
  const pulled: Pulled = { bytes: 0, largestChunk: 0, cancelled: false }
  const fetchLike: FetchLike = async (input, init) => {
    const response = await fetch(input, init)
    if (response.body === null) return response
    const reader = response.body.getReader()
    const body = new ReadableStream<Uint8Array>({
      async pull (controller) {
        const { done, value } = await reader.read()
        if (done) { controller.close(); return }
        pulled.bytes += value.byteLength
        pulled.largestChunk = Math.max(pulled.largestChunk, value.byteLength)
        controller.enqueue(value)
      },
      async cancel (reason) {
        pulled.cancelled = true
        await reader.cancel(reason)
      }
    }, { highWaterMark: 0 })
    return new Response(body, { status: response.status, statusText: response.statusText, headers: response.headers })
  }
  return { fetch: fetchLike, pulled }
}

export interface Sent { written: number, finished: boolean, closed: boolean }

/**
 * Streams `total` bytes (64 KiB writes, honouring backpressure) with a Content-Length or chunked,
 * recording how much was written and whether the client closed the connection before the end.
 */
export function bigAnswer (response: ServerResponse, total: number, framing: 'content-length' | 'chunked', sent: Sent, extra: Record<string, string> = {}): void {
  response.writeHead(200, { 'content-type': 'application/octet-stream', ...(framing === 'content-length' ? { 'content-length': String(total) } : {}), ...extra })
  const chunk = Buffer.alloc(64 * 1024, 0x61)
  response.on('close', () => { sent.closed = true; sent.finished = response.writableFinished })
  const pump = (): void => {
    while (sent.written < total && !response.destroyed) {
      const piece = total - sent.written < chunk.length ? chunk.subarray(0, total - sent.written) : chunk
      sent.written += piece.length
      if (!response.write(piece)) { response.once('drain', pump); return }
    }
    if (!response.destroyed) response.end()
  }
  pump()
}

export const MiB = 1024 * 1024
