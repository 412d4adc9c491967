import type { FastifyRequest } from 'fastify'
import type { Observed } from '../core/observe.js'

/** What a decision about a request answered before it had a state (a missing key, a status lookup) reports. */
export function observedRequest (request: FastifyRequest, key: string, scope: string, startedAt: number): Observed {
  return { key, scope, log: request.log, method: request.method, route: request.routeOptions.url ?? '', request, startedAt }
}
