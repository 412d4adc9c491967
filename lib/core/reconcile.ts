import { deriveKey } from './derive.js'
import { sealResponse } from './encryption.js'
import { InvalidOptionError } from './errors.js'
import { resolveKeyring, type EncryptionOptions, type Keyring } from './keyring.js'
import type { Fingerprint, Lease, RecordId, StepResults, StoredResponse } from './store.js'
import { callbackOption, integerOption, MAX_TIMER_MS } from './validate.js'

/**
 * Reconciliation: the answer to effects that cannot share the store's transaction. A record
 * left in progress (its owner crashed and no client retried, or the handler declared an
 * indeterminate failure) is handed to a user callback that checks the outside world, typically by
 * asking the provider about the derived keys the handler used, and decides its final state.
 */

/** A record left in progress, as the reconciler's `resolve` callback sees it. */
export interface StuckRecord extends RecordId {
  readonly fingerprint: Fingerprint
  /** Results of the steps that completed, by name. */
  readonly steps: StepResults
  /**
   * True when the handler declared the failure indeterminate (or failed after a step completed);
   * false when the owner vanished (crash, lost connection) without settling.
   */
  readonly indeterminate: boolean
  readonly createdAt: Date
  /** The key the handler's downstream call `name` carried (see `request.idempotency.deriveKey`). */
  deriveKey (name: string): string
}

/** The response a resolution records; replayed to every retry of the key from then on. */
export interface ResolvedResponse {
  readonly statusCode: number
  /** Names are lower-cased. A `body` given as an object or string gets a content-type unless one is here. */
  readonly headers?: Readonly<Record<string, string | string[]>>
  /** An object or array is sent as JSON; a string as UTF-8 text; a Buffer as is. @defaultValue no body */
  readonly body?: Buffer | string | object
}

export type Resolution =
  /** The operation happened (or definitely failed in a way worth replaying): record this response. */
  | { readonly action: 'complete', readonly response: ResolvedResponse }
  /** Nothing happened: delete the record (and its steps); the next retry runs the operation afresh. */
  | { readonly action: 'release' }
  /** Let the next retry take the record over and continue from its first incomplete step. */
  | { readonly action: 'resume' }
  /** Undecided: look again at a later pass. */
  | { readonly action: 'leave' }

export interface ReconcileOptions {
  /** Decides each stuck record. Returning nothing (or throwing) leaves it for a later pass. */
  readonly resolve: (record: StuckRecord) => Resolution | undefined | Promise<Resolution | undefined>
  /** Only records whose lease ended at least this long ago, in ms (a crashed owner's client may still retry). @defaultValue 60_000 */
  readonly olderThan?: number
  /** Most records one pass examines. @defaultValue 100 */
  readonly limit?: number
  /** How long the reconciler holds a record while `resolve` runs, in ms; retries get 409 meanwhile. @defaultValue 60_000 */
  readonly lease?: number
  /** Retention of a record completed by `resolve`, in ms. @defaultValue 86_400_000 (24 h) */
  readonly ttl?: number
  /**
   * The plugin's `encryption` option, when it has one: a response recorded by `resolve` is then
   * sealed like the plugin's own (the reconciler writes to the store directly, not through the plugin).
   */
  readonly encryption?: EncryptionOptions
}

export interface ReconcileReport {
  /** Stuck records this pass took hold of (a record another pass or a retry took first is not counted). */
  readonly examined: number
  readonly completed: number
  readonly released: number
  readonly resumed: number
  readonly left: number
  /** Resolutions the store refused: the record changed hands while `resolve` ran (force-released, or taken by a retry). */
  readonly lost: number
  /** `resolve` threw, or the store failed while applying its decision: the record is left. */
  readonly errors: ReadonlyArray<{ readonly scope: string, readonly key: string, readonly error: unknown }>
}

export interface ReconcilerOptions extends ReconcileOptions {
  /** Time between passes, in ms. @defaultValue 30_000 */
  readonly interval?: number
  /** Receives a failed pass's error and each record's error; the worker keeps running. @defaultValue none (errors are dropped) */
  readonly onError?: (error: unknown, record?: RecordId) => void
  /** Receives each pass's report (for logs and metrics). */
  readonly onReport?: (report: ReconcileReport) => void
}

export interface Reconciler {
  /** Stops the timer and waits for a pass in flight to finish. */
  stop (): Promise<void>
}

/** What a driver provides so the shared reconcile loop can run on it. */
export interface ReconcileSource {
  /** Candidates: in-progress records whose lease ended at least `olderThanMs` ago, with the token that owned them. */
  findStuck (olderThanMs: number, limit: number): Promise<Array<RecordId & { readonly token: string }>>
  /**
   * Takes a candidate over for `leaseMs` if it is still owned by `token` and still stuck (fenced,
   * like a takeover); null when something else took it first.
   */
  acquire (candidate: RecordId & { readonly token: string }, olderThanMs: number, leaseMs: number): Promise<{
    readonly lease: Lease
    readonly fingerprint: Fingerprint
    readonly steps: StepResults
    readonly indeterminate: boolean
    readonly createdAt: Date
  } | null>
  complete (lease: Lease, response: StoredResponse, ttlMs: number): Promise<boolean>
  release (lease: Lease): Promise<boolean>
  /**
   * Clears `indeterminate` and ends the lease now, so the next retry takes the record over; the
   * record, no longer held, expires again (`ttlMs` from now at the earliest).
   */
  resume (lease: Lease, ttlMs: number): Promise<boolean>
  /** Ends the lease now, keeping `indeterminate` as `wasIndeterminate`. */
  leave (lease: Lease, wasIndeterminate: boolean): Promise<boolean>
}

interface ResolvedReconcileOptions {
  readonly resolve: ReconcileOptions['resolve']
  readonly olderThan: number
  readonly limit: number
  readonly lease: number
  readonly ttl: number
  readonly keyring: Keyring | null
}

export function resolveReconcileOptions (options: ReconcileOptions, caller: string): ResolvedReconcileOptions {
  if (options === null || typeof options !== 'object') throw new InvalidOptionError(`${caller} options`, 'an object with at least { resolve }', options)
  if (typeof options.resolve !== 'function') throw new InvalidOptionError(`${caller} option "resolve"`, 'a function (record) => resolution', options.resolve)
  return {
    resolve: options.resolve,
    olderThan: integerOption(`${caller} option "olderThan"`, options.olderThan, 60_000, 0, MAX_TIMER_MS, 'ms'),
    limit: integerOption(`${caller} option "limit"`, options.limit, 100, 1, 100_000),
    lease: integerOption(`${caller} option "lease"`, options.lease, 60_000, 1, MAX_TIMER_MS, 'ms'),
    ttl: integerOption(`${caller} option "ttl"`, options.ttl, 86_400_000, 1, Number.MAX_SAFE_INTEGER, 'ms'),
    keyring: options.encryption === undefined ? null : resolveKeyring(options.encryption)
  }
}

/**
 * One pass: every candidate is first taken over (fenced), so a retry or another reconciler cannot
 * act on it while `resolve` runs, then its resolution is applied with that lease. Records are
 * handled one at a time: `resolve` usually calls a provider, and a pass should not flood it.
 */
export async function reconcileWith (source: ReconcileSource, options: ReconcileOptions, caller: string): Promise<ReconcileReport> {
  return await reconcilePass(source, resolveReconcileOptions(options, caller))
}

async function reconcilePass (source: ReconcileSource, settings: ResolvedReconcileOptions): Promise<ReconcileReport> {
  const report = { examined: 0, completed: 0, released: 0, resumed: 0, left: 0, lost: 0, errors: [] as Array<{ scope: string, key: string, error: unknown }> }
  const candidates = await source.findStuck(settings.olderThan, settings.limit)
  for (const candidate of candidates) {
    const held = await source.acquire(candidate, settings.olderThan, settings.lease)
    if (held === null) continue
    report.examined++
    const { lease } = held
    try {
      const record: StuckRecord = {
        scope: lease.scope,
        key: lease.key,
        fingerprint: held.fingerprint,
        steps: held.steps,
        indeterminate: held.indeterminate,
        createdAt: held.createdAt,
        deriveKey: (name) => deriveKey(lease.scope, lease.key, name)
      }
      const resolution = await settings.resolve(record) ?? { action: 'leave' }
      // Counted only when the store applied it: false means the record changed hands meanwhile (an
      // operator force-released it, or the reconciler's own lease lapsed and a retry took it).
      let applied: boolean
      switch (resolution.action) {
        case 'complete':
          applied = await source.complete(lease, sealed(settings.keyring, lease, held.fingerprint, storedResponse(resolution.response)), settings.ttl)
          if (applied) report.completed++
          break
        case 'release':
          applied = await source.release(lease)
          if (applied) report.released++
          break
        case 'resume':
          applied = await source.resume(lease, settings.ttl)
          if (applied) report.resumed++
          break
        case 'leave':
          applied = await source.leave(lease, held.indeterminate)
          if (applied) report.left++
          break
        default:
          throw new TypeError(`fastify-idempotency: resolve() returned an unknown action ${JSON.stringify((resolution as { action?: unknown }).action)}`)
      }
      if (!applied) report.lost++
    } catch (error) {
      report.errors.push({ scope: lease.scope, key: lease.key, error })
      // Give the record back as it was; if this fails too, the reconciler's lease simply lapses.
      await source.leave(lease, held.indeterminate).catch(() => {})
    }
  }
  return report
}

/** Sealed for the record and the fingerprint it holds, as the plugin's own complete would (lib/core/encryption.ts). */
function sealed (keyring: Keyring | null, id: RecordId, fingerprint: Fingerprint, response: StoredResponse): StoredResponse {
  return keyring === null ? response : sealResponse(keyring, id, fingerprint, response)
}

/** A response as `resolve` gives it, in the form every driver stores (and the plugin replays). */
export function storedResponse (response: ResolvedResponse): StoredResponse {
  const status = response?.statusCode
  if (!Number.isInteger(status) || status < 200 || status > 599) {
    throw new TypeError(`fastify-idempotency: a resolution's response.statusCode must be an integer from 200 to 599; received ${String(status)}`)
  }
  const headers: Record<string, string | string[]> = {}
  for (const [name, value] of Object.entries(response.headers ?? {})) headers[name.toLowerCase()] = value
  const body = response.body
  let bytes: Buffer
  if (body === undefined) {
    bytes = Buffer.alloc(0)
  } else if (Buffer.isBuffer(body)) {
    bytes = body
  } else if (typeof body === 'string') {
    bytes = Buffer.from(body, 'utf8')
    headers['content-type'] ??= 'text/plain; charset=utf-8'
  } else {
    bytes = Buffer.from(JSON.stringify(body), 'utf8')
    headers['content-type'] ??= 'application/json; charset=utf-8'
  }
  return { statusCode: status, headers, body: bytes }
}

/** What a driver adds around each pass of its reconciler. */
export interface PassHooks {
  /**
   * Wraps a pass in the driver's cross-process lock (Postgres: an advisory lock), returning false
   * when another instance holds it, so one reconciler runs at a time however many instances start one.
   */
  readonly exclusive?: (run: () => Promise<void>) => Promise<boolean>
  /** Runs after each pass, inside the lock (Postgres: the outbox's leftovers, up to `limit`). */
  readonly afterPass?: (limit: number) => Promise<unknown>
}

/**
 * Runs a reconcile pass every `interval` ms, one pass at a time, until stopped. The options are
 * validated once, here: every pass reuses them.
 */
export function startReconcilerWith (source: ReconcileSource, options: ReconcilerOptions, caller: string, hooks: PassHooks = {}): Reconciler {
  const settings = resolveReconcileOptions(options, caller)
  const exclusive = hooks.exclusive ?? (async (run) => { await run(); return true })
  const interval = integerOption(`${caller} option "interval"`, options.interval, 30_000, 1, MAX_TIMER_MS, 'ms')
  const onError = callbackOption(`${caller} option "onError"`, options.onError)
  const onReport = callbackOption(`${caller} option "onReport"`, options.onReport)
  let stopped = false
  let running: Promise<void> | null = null
  const tick = (): void => {
    if (stopped || running !== null) return
    running = exclusive(async () => {
      const report = await reconcilePass(source, settings)
      await hooks.afterPass?.(settings.limit)
      for (const failure of report.errors) onError?.(failure.error, { scope: failure.scope, key: failure.key })
      onReport?.(report)
    }).then(() => {}, (error: unknown) => { onError?.(error) }).finally(() => { running = null })
  }
  const timer = setInterval(tick, interval)
  timer.unref()
  return {
    async stop () {
      stopped = true
      clearInterval(timer)
      await running
    }
  }
}
