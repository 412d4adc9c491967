import type { Hash } from 'node:crypto'
import type { FastifyBaseLogger, FastifyRequest } from 'fastify'
import { RequestState } from '../core/context.js'
import type { RouteSettings } from '../http/options.js'

export const kState = Symbol('fastify-idempotency.state')

/** A protected request's state: the core's, plus what only an HTTP request has. Reachable only through {@link kState}. */
export class FastifyRequestState extends RequestState {
  declare readonly settings: RouteSettings
  /** Raw fingerprints: the hash of the body bytes, fed while they stream to the parser. */
  rawHash: Hash | null = null

  constructor (key: string, settings: RouteSettings, readonly request: FastifyRequest) {
    super(key, settings)
  }

  get log (): FastifyBaseLogger { return this.request.log }
  get method (): string { return this.request.method }
  get route (): string { return this.request.routeOptions.url ?? '' }
}

export type StatefulRequest = FastifyRequest & { [kState]: FastifyRequestState | null }

export function stateOf (request: FastifyRequest): FastifyRequestState | null {
  return (request as StatefulRequest)[kState]
}
