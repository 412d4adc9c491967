/**
 * The peer, `@node-idempotency/core`, wired into Fastify through its public API. Its Fastify adapter
 * (@node-idempotency/fastify) is not on the registry; this glue does what that adapter does
 * (packages/plugin-fastify in mahendraHegde/node-idempotency), what it gets wrong included:
 *
 * - preHandler: `onRequest()`; a returned response is a replay (its status, its Content-Type,
 *   `Idempotent-Replayed: true`); an IdempotencyError is sent with the adapter's status map (400,
 *   409 with `Retry-After: 1`, 422); any other error lets the request through unprotected (fail-open).
 * - onSend: `onResponse()` on every response, replays and its own 409s included (an extra fingerprint
 *   and store write each; a 409 is recorded as the key's response).
 * - A replay whose client disconnects before it is written runs the handler: the awaited reply
 *   resolves on a premature close too. A load closing its connections shows it (scenarios.ts).
 *
 * Differences: each hook is one async function where the adapter's awaits an async helper (the
 * peer's favour, marginally); Fastify 5 where the adapter targets 4 (whose API it uses unchanged).
 */
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify'
import { Idempotency, IdempotencyError, IdempotencyErrorCodes, type IdempotencyOptions, type IdempotencyParams, type IdempotencyResponse } from '@node-idempotency/core'

/** The core's storage interface (@node-idempotency/storage, a dependency of the core's). */
type StorageAdapter = ConstructorParameters<typeof Idempotency>[0]

/** @node-idempotency/shared's idempotency2HttpCodeMap. */
const STATUS_OF: Record<IdempotencyErrorCodes, number> = {
  [IdempotencyErrorCodes.IDEMPOTENCY_KEY_LEN_EXEEDED]: 400,
  [IdempotencyErrorCodes.IDEMPOTENCY_KEY_MISSING]: 400,
  [IdempotencyErrorCodes.IDEMPOTENCY_FINGERPRINT_MISSMATCH]: 422,
  [IdempotencyErrorCodes.REQUEST_IN_PROGRESS]: 409
}

/** @node-idempotency/shared's headers2Cache: the response headers recorded and replayed. */
const RECORDED_HEADERS = ['Content-Type'] as const

function params (request: FastifyRequest): IdempotencyParams {
  return {
    headers: request.headers as Record<string, unknown>,
    body: request.body as Record<string, unknown> | undefined,
    path: request.url,
    method: request.method
  }
}

/** Adds the peer's hooks to `app` (call it before the routes it should cover). */
export function peerIdempotency (app: FastifyInstance, storage: StorageAdapter, options?: IdempotencyOptions): Idempotency {
  const idempotency = new Idempotency(storage, options)

  app.addHook('preHandler', async (request: FastifyRequest, reply: FastifyReply) => {
    let cached: IdempotencyResponse<unknown, unknown> | undefined
    try {
      cached = await idempotency.onRequest<unknown, unknown>(params(request))
    } catch (err) {
      if (!(err instanceof IdempotencyError)) return // the adapter's fail-open: on to the handler
      if (err.code === IdempotencyErrorCodes.REQUEST_IN_PROGRESS) void reply.header('Retry-After', '1')
      return await reply.status(STATUS_OF[err.code] ?? 500).send(err)
    }
    if (cached === undefined) return // a new key: on to the handler
    const additional = cached.additional ?? {}
    if (additional.statusCode) void reply.status(additional.statusCode as number)
    for (const name of RECORDED_HEADERS) {
      if (additional[name]) void reply.header(name, additional[name] as string)
    }
    void reply.header('Idempotent-Replayed', 'true')
    return await reply.send(cached.body || cached.error)
  })

  app.addHook('onSend', async (request: FastifyRequest, reply: FastifyReply, payload: unknown) => {
    const { statusCode } = reply
    const additional: Record<string, unknown> = { statusCode }
    for (const name of RECORDED_HEADERS) {
      const value = reply.getHeader(name)
      if (value) additional[name] = value
    }
    await idempotency.onResponse(params(request), statusCode < 400 ? { additional, body: payload } : { additional, error: payload })
    return payload
  })

  return idempotency
}
