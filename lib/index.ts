import fp from 'fastify-plugin'
import { idempotencyPlugin } from './fastify/plugin.js'
import type { IdempotencyOptions } from './http/options.js'
import './fastify/types.js'

/**
 * Gives routes the Idempotency-Key contract (draft-ietf-httpapi-idempotency-key-header): the first
 * request with a key runs the handler once and its response is recorded; a retry with the same key
 * gets that response replayed (`Idempotent-Replayed: true`), a concurrent one 409, a different
 * request under the same key 422.
 *
 * @example
 * import Fastify from 'fastify'
 * import idempotency from 'fastify-idempotency'
 *
 * const app = Fastify()
 * await app.register(idempotency, { scope: (request) => request.accountId }) // set by your authentication hook
 * app.post('/payments', async () => ({ id: 'pay_1', status: 'succeeded' }))
 */
const fastifyIdempotency = fp<IdempotencyOptions>(idempotencyPlugin, { fastify: '5.x', name: 'fastify-idempotency' })

export default fastifyIdempotency
export { fastifyIdempotency }
export { memoryStore, MemoryStoreFullError, type MemoryStore, type MemoryStoreOptions, type MemoryStoreUsage } from '../drivers/memory.js'
export {
  EmptyScopeError, InvalidOptionError, LeaseLostError, RolledBackError, StoreNotReadyError, StoreTimeoutError, TransactionEndedError, UnprotectedRoutesError
} from './core/errors.js'
export type { EarlierRoutesPolicy } from './fastify/earlier-routes.js'
export { DEFAULT_REPLAY_HEADERS } from './http/headers.js'
export type { IdempotencyContext } from './core/context.js'
export type { InspectedRecord, RecoveryTools } from './core/admin.js'
export type { StepOptions } from './core/recovery.js'
export type {
  ReconcileOptions, Reconciler, ReconcilerOptions, ReconcileReport, Resolution, ResolvedResponse, StuckRecord
} from './core/reconcile.js'
export type { EncryptionKey, EncryptionOptions } from './core/keyring.js'
export type { FingerprintFunction, FingerprintOption } from './core/fingerprint.js'
export type { KeyFormat, KeyFunction } from './http/key.js'
export type { IdempotencyOptions, RecordRule, RouteIdempotencyOptions, ScopeFunction, StatusRouteOptions } from './http/options.js'
export { DECISION_CHANNEL, type DecisionEvent, type MeterLike, type Outcome } from './core/observe.js'
export type { IdempotencyPrefilter, PrefilterHit } from './core/prefilter.js'
export type { ProblemKind } from './http/problems.js'
export type { RebuildFunction, RebuiltResponse } from './http/reference.js'
export type { ProfileName } from './http/profiles.js'
export type { IdempotencyKeyStatus } from './http/status-route.js'
export type {
  ClaimAcquired, ClaimCompleted, ClaimInProgress, ClaimRequest, ClaimResult, Fingerprint,
  IdempotencyStore, Lease, OutboxEntry, RecordId, StepResults, StoredRecord, StoredResponse
} from './core/store.js'
