import type { FastifyRequest } from 'fastify'
import type { Observed } from '../core/observe.js'

/**
 * What a decision about a request answered before it had a state (a missing key, a status lookup)
 * reports. The route is read only if a meter or a subscriber asks for it: building `routeOptions`
 * costs a refused request something even when nobody listens.
 */
export function observedRequest (request: FastifyRequest, key: string, scope: string, startedAt: number): Observed {
  return { key, scope, log: request.log, method: request.method, get route () { return request.routeOptions.url ?? '' }, request, startedAt }
}
