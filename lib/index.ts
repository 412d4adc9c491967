import fp from 'fastify-plugin'
import { idempotencyPlugin } from './plugin.js'
import type { IdempotencyOptions } from './options.js'
import './types.js'

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
} from './errors.js'
export type { EarlierRoutesPolicy } from './earlier-routes.js'
export { DEFAULT_REPLAY_HEADERS } from './headers.js'
export type { IdempotencyContext } from './context.js'
export type { InspectedRecord, RecoveryTools } from './admin.js'
export type { StepOptions } from './recovery.js'
export type {
  ReconcileOptions, Reconciler, ReconcilerOptions, ReconcileReport, Resolution, ResolvedResponse, StuckRecord
} from './reconcile.js'
export type { EncryptionKey, EncryptionOptions } from './keyring.js'
export type { FingerprintFunction, FingerprintOption } from './fingerprint.js'
export type { KeyFormat } from './key.js'
export type { IdempotencyOptions, RecordRule, RouteIdempotencyOptions, ScopeFunction, StatusRouteOptions } from './options.js'
export { DECISION_CHANNEL, type DecisionEvent, type MeterLike, type Outcome } from './observe.js'
export type { IdempotencyPrefilter, PrefilterHit } from './prefilter.js'
export type { ProblemKind } from './problems.js'
export type { RebuildFunction, RebuiltResponse } from './reference.js'
export type { ProfileName } from './profiles.js'
export type { IdempotencyKeyStatus } from './status-route.js'
export type {
  ClaimAcquired, ClaimCompleted, ClaimInProgress, ClaimRequest, ClaimResult, Fingerprint,
  IdempotencyStore, Lease, OutboxEntry, RecordId, StepResults, StoredRecord, StoredResponse
} from './store.js'
