import cluster from 'node:cluster'
import type { FastifyInstance } from 'fastify'

/** Stable codes of the plugin's boot warnings, for `process.on('warning')` and `--disable-warning`. */
export const WARNING_CODES = Object.freeze({
  unscoped: 'FST_IDEMPOTENCY_UNSCOPED',
  memoryStore: 'FST_IDEMPOTENCY_MEMORY_STORE',
  unprotectedRoutes: 'FST_IDEMPOTENCY_UNPROTECTED_ROUTES',
  storeUnchecked: 'FST_IDEMPOTENCY_STORE_UNCHECKED'
} as const)

export type WarningCode = typeof WARNING_CODES[keyof typeof WARNING_CODES]

/**
 * Logs and emits a process warning: Fastify's default `logger: false` prints nothing, and a
 * payments route that is not what its author believes must not be silent. Emitted once per
 * registration, on purpose not once per process: every app that is misconfigured says so.
 */
export function bootWarning (fastify: FastifyInstance, code: WarningCode, message: string): void {
  fastify.log.warn({ code }, message)
  process.emitWarning(message, { type: 'FastifyIdempotencyWarning', code })
}

/** Checks the options cannot express: where the plugin runs. */
export function warnAboutDeployment (fastify: FastifyInstance, unscoped: boolean, memoryStore: boolean): void {
  if (unscoped) {
    // Draft §5: a global key namespace lets one client replay or block another's operation.
    bootWarning(fastify, WARNING_CODES.unscoped, 'fastify-idempotency: no `scope` option, so Idempotency-Keys are not scoped to a principal: ' +
      'every client shares one key space. Pass scope: (request) => <tenant or account id>.')
  }
  if (memoryStore && (process.env.NODE_ENV === 'production' || cluster.isWorker)) {
    const where = cluster.isWorker ? 'in a cluster worker' : 'with NODE_ENV=production'
    bootWarning(fastify, WARNING_CODES.memoryStore, `fastify-idempotency: the memory store is running ${where}. It keeps keys in this process only, ` +
      'so a retry that reaches another process or instance runs the operation again. Use a shared store (fastify-idempotency/postgres).')
  }
}
