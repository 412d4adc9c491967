/**
 * The peer, wired into Fastify: `@node-idempotency/core` through its public API only (its Fastify
 * adapter, @node-idempotency/fastify, is not on the registry). Modelled on that adapter's source
 * (packages/plugin-fastify/src/idempotent-fastify.ts in mahendraHegde/node-idempotency), minimal:
 *
 * - preHandler: `Idempotency.onRequest()`. A returned response is a replay: its recorded status,
 *   its recorded content-type and `Idempotent-Replayed: true`, then its body. An IdempotencyError
 *   becomes 400 (key too long / missing), 409 (in progress, with Retry-After: 1, as the adapter) or
 *   422 (fingerprint mismatch), answered with its code. Anything else propagates (500).
 * - onSend: `Idempotency.onResponse()` records the serialised payload with its status and
 *   content-type (< 400 as `body`, otherwise as `error`, as the adapter does).
 *
 * One departure from the adapter, in the peer's favour: onSend records only responses the handler
 * produced. The adapter also records the replays and the errors it answered itself (an extra store
 * write per replay, and a 409 overwriting the in-progress marker as if complete); skipping them
 * costs the peer nothing and changes none of its core's semantics.
 */
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify'
import { Idempotency, IdempotencyError, IdempotencyErrorCodes, type IdempotencyOptions, type IdempotencyParams, type IdempotencyResponse } from '@node-idempotency/core'

/** The core's storage interface (@node-idempotency/storage, a dependency of the core's). */
type StorageAdapter = ConstructorParameters<typeof Idempotency>[0]

const STATUS_OF: Record<IdempotencyErrorCodes, number> = {
  [IdempotencyErrorCodes.IDEMPOTENCY_KEY_LEN_EXEEDED]: 400,
  [IdempotencyErrorCodes.IDEMPOTENCY_KEY_MISSING]: 400,
  [IdempotencyErrorCodes.IDEMPOTENCY_FINGERPRINT_MISSMATCH]: 422,
  [IdempotencyErrorCodes.REQUEST_IN_PROGRESS]: 409
}

/** Replies the preHandler answered itself, which onSend must not record. */
const answered = new WeakSet<FastifyRequest>()

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
    let cached: IdempotencyResponse<string, string> | undefined
    try {
      cached = await idempotency.onRequest<string, string>(params(request))
    } catch (err) {
      if (!(err instanceof IdempotencyError)) throw err
      answered.add(request)
      if (err.code === IdempotencyErrorCodes.REQUEST_IN_PROGRESS) void reply.header('retry-after', '1')
      return reply.code(STATUS_OF[err.code] ?? 500).send({ code: err.code, message: err.message })
    }
    if (cached === undefined) return // a new key: on to the handler
    answered.add(request)
    const additional = cached.additional ?? {}
    if (typeof additional.statusCode === 'number') void reply.code(additional.statusCode)
    if (typeof additional['content-type'] === 'string') void reply.header('content-type', additional['content-type'])
    return reply.header('idempotent-replayed', 'true').send(cached.body ?? cached.error)
  })

  app.addHook('onSend', async (request: FastifyRequest, reply: FastifyReply, payload: unknown) => {
    if (answered.has(request)) return payload
    const { statusCode } = reply
    const additional: Record<string, unknown> = { statusCode }
    const type = reply.getHeader('content-type')
    if (type !== undefined) additional['content-type'] = type
    await idempotency.onResponse(params(request), statusCode < 400 ? { additional, body: payload } : { additional, error: payload })
    return payload
  })

  return idempotency
}
