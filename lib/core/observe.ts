import diagnostics from 'node:diagnostics_channel'
import { InvalidOptionError } from './errors.js'

/**
 * Every decision the plugin takes about a key, in one place: a log line (built only when its level
 * is enabled), an event on a diagnostics channel (built only when someone subscribes) and the
 * metrics of an OpenTelemetry-compatible meter (only when one is configured). The 409 and 422 rates
 * are the operational signals: a rising 409 rate means clients retry while originals
 * still run (too short a client timeout, a slow handler); a rising 422 rate means clients reuse keys
 * across different operations (a client bug that this contract exists to surface).
 */

export type Outcome =
  /** The request owns the key and runs the handler. */
  | 'executed'
  /** Like executed, after taking over a key whose owner stopped renewing its lease. */
  | 'taken_over'
  | 'replayed'
  /** 409: the original is in flight (or held for reconciliation). */
  | 'conflict'
  /** 422: the key was used for a different request. */
  | 'mismatch'
  /** 410: completed, but its response was larger than maxResponseBytes. */
  | 'not_retained'
  /** 400: the key is missing (and required) or malformed. */
  | 'key_missing'
  | 'key_invalid'
  /** 400 / 413: the parsed body is beyond the route's maxBodyDepth or maxBodyNodes (canonical fingerprints). */
  | 'body_refused'
  /** The owner's response was recorded. */
  | 'recorded'
  /** The owner's failure was definite: the key was released for a retry to run again. */
  | 'released'
  /** The owner's failure was indeterminate: the key is held for the reconciler. */
  | 'held'
  /** The response left around Fastify (hijack, raw write): nothing to record. */
  | 'not_recorded'
  /** The owner lost its key to another attempt: its outcome is not recorded. */
  | 'lease_lost'
  /** The owner reached the route's `maxOwnership` while still holding its key: its lease is no longer renewed. */
  | 'ownership_expired'
  /** An unexpected error while settling the owner's answer (a throwing `record` rule): released or held, not recorded. */
  | 'settle_failed'
  /** The store failed or timed out (503, a 500 commit failure, or a logged background failure). */
  | 'store_error'
  /** The store failed and `onStoreError: 'bypass'` ran the handler unprotected. */
  | 'bypassed'
  | 'prefilter_error'

export type Level = 'debug' | 'info' | 'warn' | 'error'

/**
 * What the diagnostics channel `fastify-idempotency:decision` publishes. `Request` is the Fastify
 * request for a route's decision and undefined for a job's (the main entry point exports it so).
 */
export interface DecisionEvent<Request = unknown> {
  readonly outcome: Outcome
  readonly scope: string
  /** The full key: subscribers run in-process (log lines only carry a truncated key). */
  readonly key: string
  /** The HTTP method, or `RUN` for a job. */
  readonly method: string
  /** The route's path pattern (`/payments/:id`), not the URL, or the job's operation: a bounded set of values. */
  readonly route: string
  /** Milliseconds since the request reached the plugin's first hook, or since the job's run started. */
  readonly durationMs: number
  readonly request: Request
}

/** The name of the diagnostics channel (`node:diagnostics_channel`) every decision is published on. */
export const DECISION_CHANNEL = 'fastify-idempotency:decision'
const channel = diagnostics.channel(DECISION_CHANNEL)

/**
 * The subset of an OpenTelemetry `Meter` the plugin uses (`metrics.getMeter('…')` from
 * `@opentelemetry/api` fits it), so the plugin depends on no metrics library: anything with these
 * two methods works (a Prometheus adapter, a test double).
 */
export interface MeterLike {
  createCounter (name: string, options?: { description?: string, unit?: string }): { add (value: number, attributes?: Record<string, string>): void }
  createHistogram (name: string, options?: { description?: string, unit?: string }): { record (value: number, attributes?: Record<string, string>): void }
}

export interface Metrics {
  readonly decisions: ReturnType<MeterLike['createCounter']>
  readonly duration: ReturnType<MeterLike['createHistogram']>
}

/** Instrument names follow OpenTelemetry's conventions (dot-separated, unit in the metadata). */
export function createMetrics (meter: unknown): Metrics | null {
  if (meter === undefined) return null
  const candidate = meter as Partial<MeterLike> | null
  if (typeof candidate?.createCounter !== 'function' || typeof candidate.createHistogram !== 'function') {
    throw new InvalidOptionError('option "metrics"', 'an OpenTelemetry-compatible Meter (with createCounter and createHistogram)', meter)
  }
  return {
    decisions: candidate.createCounter('idempotency.decisions', { description: 'Idempotency decisions, by outcome' }),
    duration: candidate.createHistogram('idempotency.decision.duration', {
      description: 'Time from the request reaching the plugin to each decision, by outcome',
      unit: 'ms'
    })
  }
}

/**
 * A logger as the core uses it: pino's (Fastify's `request.log`) fits, and so does any object with
 * these methods. `isLevelEnabled`, when present, spares building a log object nobody reads.
 */
export interface Logger {
  debug (obj: object, msg?: string): void
  info (obj: object, msg?: string): void
  warn (obj: object, msg?: string): void
  error (obj: object, msg?: string): void
  isLevelEnabled? (level: string): boolean
}

/** What a decision needs to know about its request; RequestState provides it. */
export interface Observed {
  readonly key: string
  readonly scope: string
  readonly log: Logger
  readonly method: string
  readonly route: string
  readonly request: unknown
  readonly startedAt: number
}

/**
 * Records one decision. The log object is only built when `level` is enabled (a replayed request,
 * at debug, builds nothing in production), and the key in it is truncated: log pipelines are read
 * by more people than the database is, and a key may be guessable or reused by a careless client.
 */
export function observe (metrics: Metrics | null, subject: Observed, outcome: Outcome, level: Level, message: string, err?: unknown): void {
  const log = subject.log
  if (enabled(log, level)) {
    const fields: Record<string, unknown> = { idempotency: { outcome, scope: subject.scope, key: truncate(subject.key) } }
    if (err !== undefined) fields.err = err
    log[level](fields, message)
  }
  if (metrics === null && !channel.hasSubscribers) return
  const durationMs = performance.now() - subject.startedAt
  const method = subject.method
  const route = subject.route
  if (metrics !== null) {
    const attributes = { outcome, method, route }
    metrics.decisions.add(1, attributes)
    metrics.duration.record(durationMs, attributes)
  }
  if (channel.hasSubscribers) {
    const event: DecisionEvent = { outcome, scope: subject.scope, key: subject.key, method, route, durationMs, request: subject.request }
    channel.publish(event)
  }
}

/**
 * pino's isLevelEnabled; a logger without it is simply called, except Fastify's own silent logger
 * (`logger: false`, abstract-logging), whose every method is one no-op: building a log object for
 * it on every request is pure waste.
 */
function enabled (log: Logger, level: Level): boolean {
  const check = log.isLevelEnabled
  if (check !== undefined) return check.call(log, level) !== false
  const methods = log as Logger & { fatal?: unknown, trace?: unknown }
  return !(methods.fatal === log.error && log.error === log.info && log.info === methods.trace)
}

function truncate (key: string): string {
  return key.length > 12 ? `${key.slice(0, 8)}…` : key
}
