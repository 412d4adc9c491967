import type { IdempotencyContext } from '../core/context.js'
import type { IdempotencyRunner } from '../jobs/runner.js'
import type { IdempotencyOptions, RouteIdempotencyOptions } from '../http/options.js'

/** Registration-only options (store, methods, ...) are refused in a route's config at compile time too. */
type RegistrationOnly = { readonly [K in Exclude<keyof IdempotencyOptions, keyof RouteIdempotencyOptions>]?: never }

declare module 'fastify' {
  interface FastifyInstance {
    /**
     * Runs a function once per key, with this registration's store, defaults and encryption: for
     * background jobs and queue consumers (`fastify.idempotency.run(options, fn)`).
     */
    idempotency: IdempotencyRunner
  }

  interface FastifyContextConfig {
    /**
     * `false` opts the route out; `true` opts it in (also for a method outside `methods`, such as
     * PUT or DELETE); an object opts it in with per-route options. Validated when the route is added.
     */
    idempotency?: boolean | (RouteIdempotencyOptions & RegistrationOnly & object)
  }

  interface FastifyRequest {
    /** The key, scope and fingerprint of a protected request; null on requests the plugin does not protect. */
    idempotency: IdempotencyContext | null
  }
}
