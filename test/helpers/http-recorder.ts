import { createServer, type IncomingMessage, type ServerResponse } from 'node:http'
import type { Test } from 'tap'

/*
 * Real HTTP servers on loopback for the client's security tests: each records every request it
 * receives, so "nothing was sent there" is a count.
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
