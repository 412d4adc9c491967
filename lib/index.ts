import fp from 'fastify-plugin'
import { idempotencyPlugin } from './fastify/plugin.js'
import type { IdempotencyOptions } from './http/options.js'
import type { DecisionEvent as CoreDecisionEvent } from './core/observe.js'
import type { FastifyRequest } from 'fastify'
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
export { idempotencyRunner, type IdempotencyRunner, type IdempotentOperation, type RunResult, type StandaloneRunner } from './jobs/runner.js'
export type { RunnerOptions, RunOptions } from './jobs/options.js'
export { memoryStore, MemoryStoreFullError, type MemoryStore, type MemoryStoreOptions, type MemoryStoreUsage } from '../drivers/memory.js'
export {
  EmptyScopeError, InvalidOptionError, KeyReusedError, LeaseLostError, OperationInProgressError, RolledBackError, StoreNotReadyError, StoreTimeoutError,
  StoreUnavailableError, TransactionEndedError, UnprotectedRoutesError
} from './core/errors.js'
export { DEFAULT_REPLAY_HEADERS } from './http/headers.js'
export type { IdempotencyContext } from './core/context.js'
export type { InspectedRecord, RecoveryTools } from './core/admin.js'
export type { StepOptions } from './core/recovery.js'
export type {
  ReconcileOptions, Reconciler, ReconcilerOptions, ReconcileReport, Resolution, ResolvedResponse, StuckRecord
} from './core/reconcile.js'
export type { EncryptionKey, EncryptionOptions } from './core/keyring.js'
export type { KeyFormat, KeyFunction } from './http/key.js'
export type { EarlierRoutesPolicy, FingerprintFunction, FingerprintOption, IdempotencyOptions, RecordRule, RouteIdempotencyOptions, ScopeFunction, StatusRouteOptions } from './http/options.js'
export { DECISION_CHANNEL, type MeterLike, type Outcome } from './core/observe.js'
/** A decision on the diagnostics channel: `request` is the Fastify request, or undefined for a job's run. */
export type DecisionEvent = CoreDecisionEvent<FastifyRequest | undefined>
export type { IdempotencyPrefilter, PrefilterHit } from './core/prefilter.js'
export type { ProblemKind } from './http/problems.js'
export type { RebuildFunction, RebuiltResponse } from './http/reference.js'
export type { ProfileName } from './http/profiles.js'
export type { IdempotencyKeyStatus } from './http/status-route.js'
export type {
  ClaimAcquired, ClaimCompleted, ClaimInProgress, ClaimRequest, ClaimResult, Fingerprint,
  IdempotencyStore, InTransactionClaimRequest, Lease, OutboxEntry, RecordId, SettlementHandlers, StepResults, StoredRecord, StoredResponse
} from './core/store.js'
export { settlementDigest } from './core/waiters.js'
