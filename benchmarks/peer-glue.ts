/**
 * The peer, wired into Fastify: `@node-idempotency/core` through its public API only. Its own
 * Fastify adapter, @node-idempotency/fastify 1.0.7, is not on the registry; this glue does what that
 * adapter does (packages/plugin-fastify/src/idempotent-fastify.ts in mahendraHegde/node-idempotency
 * at 622b33f, read, not copied), behaviour for behaviour, including what it gets wrong:
 *
 * - preHandler: `Idempotency.onRequest()`. A returned response is a replay: its recorded status,
 *   its recorded Content-Type and `Idempotent-Replayed: true`, then its body (or its error), sent
 *   and awaited (the reply is a thenable: the hook resolves once the response has been written). An
 *   IdempotencyError is sent as it is with the adapter's status map (@node-idempotency/shared:
 *   400 key too long / missing, 409 in progress with `Retry-After: 1`, 422 fingerprint mismatch),
 *   so Fastify's default error handler serialises it. Any other error is swallowed and the request
 *   goes on to the handler, unprotected (the adapter's fail-open).
 * - onSend: `Idempotency.onResponse()` on EVERY response, as the adapter does: the handler's, and
 *   also the replays and the 409/422 the preHandler answered itself (each an extra fingerprint and
 *   an extra store write; a 409 overwrites the in-progress marker as if the key had completed).
 *   Status < 400 is recorded as `body`, otherwise as `error`, with the status and Content-Type.
 *
 * What the adapter does that this glue reproduces and run.ts reports (warnings, not failures):
 * - A replay whose client disconnects before it is written runs the handler: the preHandler awaits
 *   the reply, which resolves on a premature close too, and the reply is then not `sent`, so
 *   Fastify goes on to the handler. The load generator closes its connections when a load stops, so
 *   the storm shows up to one extra execution per connection (none while the load runs).
 * - A 409 the preHandler answered is recorded as the key's completed response; a replay of it
 *   records it again, so a key can end up replaying 409 after its handler's 201 was recorded.
 *
 * What still differs from the adapter, and in whose favour:
 * - The adapter's hooks are async functions awaiting an async helper; here each hook is one async
 *   function (one promise fewer per hook): the peer's favour, marginally.
 * - The adapter is built for Fastify 4 (its package depends on fastify ^4 and fastify-plugin ^4);
 *   it runs here on Fastify 5, whose hook, reply and error-handler API it uses unchanged: neutral.
 * - The adapter creates its storage adapter itself (`buildStorageAdapter`, from options) and
 *   disconnects it in an onClose hook; here server.ts constructs the same adapter classes and
 *   disconnects them after app.close(): neutral.
 * - For peer-redis, server.ts counts the storage adapter's calls (one closure per call, for the
 *   Redis commands per request): against the peer, marginally, as our own Redis client's counting is
 *   against us.
 * The adapter is registered through fastify-plugin (its README), so its hooks apply to every route;
 * here they are added to the root instance directly: the same.
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
