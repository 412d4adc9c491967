import type { Hash } from 'node:crypto'
import type { FastifyBaseLogger, FastifyRequest } from 'fastify'
import type { RouteSettings } from './options.js'
import type { Fingerprint, Lease } from './store.js'

/** What a protected request exposes as `request.idempotency`. */
export interface IdempotencyContext {
  /** The key as the client meant it (an sf-string's value, without quotes or escapes). */
  readonly key: string
  /** The principal that owns the key. */
  readonly scope: string
  readonly fingerprint: Fingerprint
  /** True when this request was answered from the record instead of running the handler. */
  readonly replayed: boolean
}

/**
 * Where a protected request stands:
 * parsed → (claim) → owner → settling → settled
 *                  ↘ replayed | answered (a problem) | unprotected (store failure, `bypass`)
 */
export type Phase = 'parsed' | 'owner' | 'settling' | 'settled' | 'replayed' | 'answered' | 'unprotected'

export const kState = Symbol('fastify-idempotency.state')

/** Per-request state, reachable only through {@link kState}. */
export class RequestState {
  phase: Phase = 'parsed'
  scope = ''
  rawHash: Hash | null = null
  lease: Lease | null = null
  renewTimer: NodeJS.Timeout | null = null
  /** The handler (or a hook after it) threw: the outcome is a failure, never recorded. */
  errored = false
  /** The client went away or the socket timed out: the lease is no longer renewed. */
  abandoned = false
  /** Atomic mode: the lease holds an open transaction (committed by complete, rolled back by release). */
  transactional = false
  context: { key: string, scope: string, fingerprint: Fingerprint, replayed: boolean, sql?: unknown } | null = null

  constructor (
    readonly key: string,
    readonly settings: RouteSettings,
    readonly log: FastifyBaseLogger
  ) {}
}

export type StatefulRequest = FastifyRequest & { [kState]: RequestState | null }

export function stateOf (request: FastifyRequest): RequestState | null {
  return (request as StatefulRequest)[kState]
}
