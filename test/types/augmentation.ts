/*
 * Type tests for the route config augmentation (`config.idempotency`) and `request.idempotency`.
 * Not a test file: it is only type-checked (`tsc --noEmit -p .`, part of `npm test`). Every
 * `@ts-expect-error` below must really be an error: tsc reports an unused one.
 * Nothing here runs: the checks live in a function that is never called.
 */
import Fastify, { type FastifyRequest } from 'fastify'
import idempotency, { memoryStore, type IdempotencyContext, type RouteIdempotencyOptions } from '../../lib/index.js'

export function typeTests (): void {
  const app = Fastify()
  app.register(idempotency, { scope: (request) => String(request.headers['x-tenant']) })

  // ---- route config that compiles ------------------------------------------------------------
  app.post('/off', { config: { idempotency: false } }, async () => ({}))
  app.put('/on', { config: { idempotency: true } }, async () => ({}))
  app.post('/object', { config: { idempotency: { ttl: 1000, required: true, keyFormat: 'strict', fingerprint: 'raw' } } }, async () => ({}))
  app.post('/lenient', { config: { idempotency: { keyFormat: 'lenient', fingerprint: 'canonical', lease: 500, wait: 100 } } }, async () => ({}))
  app.post('/custom', { config: { idempotency: { fingerprint: (request) => request.url, record: (status) => status < 300, scope: async () => 'tenant' } } }, async () => ({}))
  app.route({ method: 'DELETE', url: '/route', config: { idempotency: { onStoreError: 'bypass', replayHeaders: ['location'] } }, handler: async () => ({}) })
  app.post('/none', async () => ({}))
  const options: RouteIdempotencyOptions = { ttl: 60_000, maxResponseBytes: 1024, retryAfter: 2, storeTimeout: 100, maxKeyLength: 64 }
  app.post('/typed', { config: { idempotency: options } }, async () => ({}))

  // ---- route config that must not compile ----------------------------------------------------
  // @ts-expect-error ttl is a number of milliseconds
  app.post('/e1', { config: { idempotency: { ttl: 'x' } } }, async () => ({}))
  // @ts-expect-error keyFormat is 'strict' | 'lenient'
  app.post('/e2', { config: { idempotency: { keyFormat: 'loose' } } }, async () => ({}))
  // @ts-expect-error store is a registration option, not a route option
  app.post('/e3', { config: { idempotency: { store: memoryStore() } } }, async () => ({}))
  // @ts-expect-error idempotency is a boolean or an object
  app.post('/e4', { config: { idempotency: 'yes' } }, async () => ({}))
  // @ts-expect-error methods is a registration option, not a route option
  app.post('/e5', { config: { idempotency: { methods: ['PUT'] } } }, async () => ({}))
  // @ts-expect-error fingerprint is 'canonical', 'raw' or a function
  app.post('/e6', { config: { idempotency: { fingerprint: 'sha1' } } }, async () => ({}))
  // @ts-expect-error required is a boolean
  app.post('/e7', { config: { idempotency: { required: 'true' } } }, async () => ({}))

  // ---- request.idempotency -------------------------------------------------------------------
  app.post('/context', async (request) => {
    const check: IdempotencyContext | null = request.idempotency
    // @ts-expect-error request.idempotency is null on unprotected requests
    const unchecked: string = request.idempotency.key
    if (request.idempotency !== null) {
      const key: string = request.idempotency.key
      const scope: string = request.idempotency.scope
      const replayed: boolean = request.idempotency.replayed
      const algorithm: string = request.idempotency.fingerprint.algorithm
      const digest: Buffer = request.idempotency.fingerprint.digest
      // @ts-expect-error the context is read-only
      request.idempotency.key = 'other'
      return { check, unchecked, key, scope, replayed, algorithm, digest }
    }
    return { check, unchecked }
  })

  // The declaration is on FastifyRequest itself, so it is visible in any hook or helper.
  const fromHook = (request: FastifyRequest): IdempotencyContext | null => request.idempotency
  // @ts-expect-error not IdempotencyContext alone: it may be null
  const notNull = (request: FastifyRequest): IdempotencyContext => request.idempotency
  void fromHook
  void notNull
}
