import type { FastifyReply, FastifyRequest } from 'fastify'
import { replyValue } from './headers.js'
import type { StoredResponse } from '../core/store.js'

/*
 * Responses by reference. Recording every response body is a cost that surprises people (a
 * payments API keeps a day of full responses): a route can record a small reference to the created
 * resource instead, and rebuild the response from the resource's current state on replay. The
 * trade-off is the route's to make: a replay then shows the resource as it is now, not byte for byte
 * what the original answer said (draft §2.6 asks for the original outcome; the status and the
 * recorded headers are the original's, the body is current).
 */

/** What `rebuild` returns; `statusCode` and `headers` default to the original answer's. */
export interface RebuiltResponse {
  readonly statusCode?: number
  readonly headers?: Readonly<Record<string, string | string[]>>
  /** Sent with `reply.send()`, so it is serialized like a handler's return value (the route's response schema applies). */
  readonly body: unknown
}

/**
 * Rebuilds a replay from the reference the handler set (`request.idempotency.reference`). It runs
 * instead of the handler, for retries only; `reference` is the JSON round trip of what was set.
 */
export type RebuildFunction = (reference: unknown, request: FastifyRequest) => RebuiltResponse | Promise<RebuiltResponse>

/**
 * Marks a record whose body is a reference. Not an RFC 9110 token (`/` is no tchar), so no real
 * header has this name and `replayHeaders` refuses it: a handler cannot forge one.
 */
export const REFERENCE_HEADER = 'fastify-idempotency/reference'
const FORMAT = 'v1'

/** The record of a response by reference: the original status and replayable headers, and the reference as JSON. */
export function referenceRecord (statusCode: number, headers: Record<string, string | string[]>, reference: unknown): StoredResponse | null {
  let json: string | undefined
  try {
    json = JSON.stringify(reference)
  } catch {
    return null
  }
  if (json === undefined) return null
  return { statusCode, headers: { ...headers, [REFERENCE_HEADER]: FORMAT }, body: Buffer.from(json, 'utf8') }
}

export function isReference (response: StoredResponse): boolean {
  return response.headers[REFERENCE_HEADER] !== undefined
}

/** The recorded replayable headers of a reference record, without its marker field. */
export function withoutMarker (headers: StoredResponse['headers']): Record<string, string | string[]> {
  const recorded: Record<string, string | string[]> = {}
  for (const name in headers) if (name !== REFERENCE_HEADER) recorded[name] = headers[name] as string | string[]
  return recorded
}

/** Answers a replay of a reference record (the caller has set Idempotent-Replayed). */
export async function sendRebuilt (rebuild: RebuildFunction, request: FastifyRequest, reply: FastifyReply, response: StoredResponse): Promise<FastifyReply> {
  const reference: unknown = JSON.parse((response.body as Buffer).toString('utf8'))
  const rebuilt = await rebuild(reference, request)
  if (rebuilt === null || typeof rebuilt !== 'object' || !('body' in rebuilt)) {
    throw new TypeError('fastify-idempotency: rebuild(reference, request) must return { body, statusCode?, headers? }')
  }
  reply.code(rebuilt.statusCode ?? response.statusCode)
  for (const name in response.headers) if (name !== REFERENCE_HEADER) reply.header(name, replyValue(response.headers[name] as string | string[]))
  for (const name in rebuilt.headers ?? {}) reply.header(name, rebuilt.headers?.[name])
  return reply.send(rebuilt.body)
}
