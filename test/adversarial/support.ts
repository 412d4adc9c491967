import assert from 'node:assert/strict'
import net from 'node:net'
import { Writable } from 'node:stream'
import type { FastifyInstance, LightMyRequestResponse } from 'fastify'
import type { IdempotencyStore } from '../../lib/core/store.js'

/**
 * Shared by the adversarial tests. Assertions here use node:assert, not tap: inside a fast-check
 * property a failure must throw (so fast-check can shrink it and print the seed), and tap
 * assertions would record one failure per shrinking step.
 */

export const PROBLEM_BASE = 'tag:fastify-idempotency,2026:'

/**
 * fast-check settings: a fixed seed so a failure reproduces, and a bounded number of runs so each
 * file takes seconds. FC_SEED / FC_RUNS override both, to explore further by hand.
 */
export function fcParams (seed: number, numRuns: number): { seed: number, numRuns: number } {
  const envSeed = process.env.FC_SEED
  const envRuns = process.env.FC_RUNS
  return {
    seed: envSeed === undefined || envSeed === '' ? seed : Number(envSeed),
    numRuns: envRuns === undefined || envRuns === '' ? numRuns : Number(envRuns)
  }
}

/** Something with the parts of a response the assertions read (inject's or a raw socket's). */
export interface AnyResponse {
  readonly statusCode: number
  readonly headers: Record<string, string | string[] | number | undefined>
  readonly body: string
}

/** Asserts a plugin problem of `kind` with its `status` (RFC 9457), and returns the parsed body. */
export function assertProblem (res: AnyResponse, kind: string, status: number, what = ''): Record<string, unknown> {
  const label = what === '' ? kind : `${what}: ${kind}`
  assert.equal(res.statusCode, status, `${label}: status ${status}, got ${res.statusCode} ${res.body.slice(0, 200)}`)
  assert.match(String(res.headers['content-type']), /^application\/problem\+json(;|$)/, `${label}: a problem document`)
  const body = JSON.parse(res.body) as Record<string, unknown>
  assert.equal(body.type, PROBLEM_BASE + kind, `${label}: problem type`)
  assert.equal(body.status, status, `${label}: status member`)
  return body
}

/** Fastify's `logger` option writing error-level lines into `lines`: a 500 or a crash in a hook logs one. */
export function errorLog (): { readonly logger: { level: string, stream: Writable }, readonly lines: string[] } {
  const lines: string[] = []
  const stream = new Writable({
    write (chunk: Buffer, _encoding, callback) {
      lines.push(chunk.toString())
      callback()
    }
  })
  return { logger: { level: 'error', stream }, lines }
}

export interface CountedStore extends IdempotencyStore {
  /** Calls to claim: a request refused before the store never reaches it. */
  readonly claims: () => number
}

/** Wraps a store to count its claims. */
export function counted (inner: IdempotencyStore): CountedStore {
  let claims = 0
  return {
    claim: async (request) => { claims++; return await inner.claim(request) },
    complete: async (lease, response, ttl) => await inner.complete(lease, response, ttl),
    release: async (lease) => await inner.release(lease),
    renew: async (lease, ms) => await inner.renew(lease, ms),
    get: async (id) => await inner.get(id),
    purgeExpired: async (limit) => await inner.purgeExpired(limit),
    close: async () => { await inner.close() },
    claims: () => claims
  }
}

export const json = (res: LightMyRequestResponse): Record<string, unknown> => JSON.parse(res.body) as Record<string, unknown>

/** Starts `app` on a loopback port and returns the port. */
export async function listen (app: FastifyInstance): Promise<number> {
  await app.listen({ port: 0, host: '127.0.0.1' })
  const address = app.server.address()
  if (address === null || typeof address === 'string') throw new Error('the server has no port')
  return address.port
}

export interface RawResponse extends AnyResponse {
  readonly headers: Record<string, string>
  /** The whole answer as received, for messages. */
  readonly text: string
}

/**
 * Writes `bytes` to a fresh connection as they are (no header normalisation, unlike inject) and
 * reads until the server closes it. Resolves statusCode 0 when the server closed without an answer.
 */
export function rawExchange (port: number, bytes: Buffer): Promise<RawResponse> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = []
    const socket = net.connect(port, '127.0.0.1', () => { socket.end(bytes) })
    socket.setTimeout(5000, () => socket.destroy(new Error('the raw request timed out')))
    socket.on('data', (chunk: Buffer) => chunks.push(chunk))
    // The server may answer and close before it read everything we sent (431, 413): a reset
    // after its answer is not a failure of the exchange.
    socket.on('error', (err: NodeJS.ErrnoException) => { if (err.code !== 'ECONNRESET' && err.code !== 'EPIPE') reject(err) })
    socket.on('close', () => {
      const text = Buffer.concat(chunks).toString('latin1')
      const split = text.indexOf('\r\n\r\n')
      const head = split === -1 ? text : text.slice(0, split)
      const lines = head.split('\r\n')
      const status = /^HTTP\/1\.1 (\d{3})/.exec(lines[0] ?? '')
      const headers: Record<string, string> = {}
      for (const line of lines.slice(1)) {
        const colon = line.indexOf(':')
        if (colon > 0) headers[line.slice(0, colon).toLowerCase()] = line.slice(colon + 1).trim()
      }
      resolve({ statusCode: status === null ? 0 : Number(status[1]), headers, body: split === -1 ? '' : text.slice(split + 4), text })
    })
  })
}

/** A POST with a JSON body whose header section is `extraHeaders` verbatim (latin1, CRLF-terminated lines). */
export function rawPost (port: number, path: string, extraHeaders: string | Buffer, body = '{"amount":100}'): Promise<RawResponse> {
  return rawExchange(port, Buffer.concat([
    Buffer.from(`POST ${path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n` +
      `Content-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n`, 'latin1'),
    typeof extraHeaders === 'string' ? Buffer.from(extraHeaders, 'latin1') : extraHeaders,
    Buffer.from('\r\n' + body, 'utf8')
  ]))
}
