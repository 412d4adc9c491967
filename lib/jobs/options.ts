import { InvalidOptionError } from '../core/errors.js'
import type { EncryptionOptions } from '../core/keyring.js'
import type { Logger, MeterLike } from '../core/observe.js'
import type { IdempotencyPrefilter } from '../core/prefilter.js'
import type { CoreSettings } from '../core/settings.js'
import type { IdempotencyStore } from '../core/store.js'
import { booleanOption, integerOption, MAX_TIMER_MS, missingMethods } from '../core/validate.js'

/** What every run of a job runner shares (`idempotencyRunner(options)`); a run may override the timing. */
export interface RunnerOptions {
  /** Where keys are claimed and values recorded: the same store a Fastify app uses shares its records. */
  readonly store: IdempotencyStore
  readonly prefilter?: IdempotencyPrefilter
  /** How long a value is kept after its run completed, in ms. @defaultValue 86_400_000 (24 h) */
  readonly ttl?: number
  /** How long a crashed run's key stays taken before a redelivery may take it over, in ms (renewed while `fn` runs). @defaultValue 30_000 */
  readonly lease?: number
  /** The longest a live run keeps renewing its lease, in ms; 0 for as long as it runs. @defaultValue 0 */
  readonly maxOwnership?: number
  /** How long a duplicate waits for a running original before OperationInProgressError, in ms. @defaultValue 0 */
  readonly wait?: number
  /** The bound on every store call, in ms. @defaultValue 5_000 */
  readonly storeTimeout?: number
  /** OperationInProgressError's `retryAfter`, in ms. @defaultValue 1_000 */
  readonly retryAfter?: number
  /** Atomic mode by default (PostgreSQL store): a run's writes through `op.sql` commit with its record. @defaultValue false */
  readonly transaction?: boolean
  /** Seals recorded values and keys fingerprints, as the plugin's option does. */
  readonly encryption?: EncryptionOptions
  readonly metrics?: MeterLike
  /** Where decisions are logged (a pino logger fits). @defaultValue nothing is logged */
  readonly log?: Logger
}

/** One run: what it is (key, operation, payload), whose (scope), and its timing if not the runner's. */
export interface RunOptions {
  /** One key per logical operation: the same on every delivery of the job (a message id, an order id). */
  readonly key: string
  /** What the key runs, like a route: the same key with another operation is refused (KeyReusedError). */
  readonly operation: string
  /** The job's input as JSON: fingerprinted with `operation`, so a key reused with another payload is refused. */
  readonly payload?: unknown
  /** The principal that owns the key (a tenant). @defaultValue '' */
  readonly scope?: string
  readonly ttl?: number
  readonly lease?: number
  readonly wait?: number
  readonly transaction?: boolean
}

const RUNNER_OPTION_NAMES = new Set(['store', 'prefilter', 'ttl', 'lease', 'maxOwnership', 'wait', 'storeTimeout', 'retryAfter', 'transaction', 'encryption', 'metrics', 'log'])
const RUN_OPTION_NAMES = new Set(['key', 'operation', 'payload', 'scope', 'ttl', 'lease', 'wait', 'transaction'])

/** The longest key or operation name: the plugin's largest `maxKeyLength`. */
const MAX_NAME_LENGTH = 8192

export interface RunnerDefaults {
  readonly settings: CoreSettings
  /** The `log` option, or a logger that logs nothing. */
  readonly log: Logger
  /** OperationInProgressError's `retryAfter`, in ms. */
  readonly retryAfterMs: number
}

/** A run, validated: its key, operation, scope, the payload's JSON form, and its settings. */
export interface ResolvedRun {
  readonly key: string
  readonly operation: string
  readonly scope: string
  readonly payload: unknown
  readonly settings: CoreSettings
}

/** The runner's timing, validated once when it is built. */
export function resolveRunnerDefaults (options: RunnerOptions): RunnerDefaults {
  const name = (option: string): string => `idempotencyRunner() option "${option}"`
  if (options === null || typeof options !== 'object' || Array.isArray(options)) throw new InvalidOptionError('idempotencyRunner() options', 'an object with a store', options)
  for (const option of Object.keys(options)) {
    if (!RUNNER_OPTION_NAMES.has(option)) throw new InvalidOptionError(name(option), `one of ${[...RUNNER_OPTION_NAMES].join(', ')}`, (options as unknown as Record<string, unknown>)[option])
  }
  const ttl = integerOption(name('ttl'), options.ttl, 24 * 60 * 60 * 1000, 1, MAX_TIMER_MS, 'milliseconds')
  const retryAfterMs = integerOption(name('retryAfter'), options.retryAfter, 1_000, 0, MAX_TIMER_MS, 'milliseconds')
  const settings: CoreSettings = Object.freeze({
    ttl,
    lease: integerOption(name('lease'), options.lease, Math.min(30_000, ttl), 1, ttl, 'milliseconds'),
    maxOwnership: integerOption(name('maxOwnership'), options.maxOwnership, 0, 0, MAX_TIMER_MS, 'milliseconds'),
    wait: integerOption(name('wait'), options.wait, 0, 0, MAX_TIMER_MS, 'milliseconds'),
    storeTimeout: integerOption(name('storeTimeout'), options.storeTimeout, 5_000, 1, MAX_TIMER_MS, 'milliseconds'),
    retryAfter: Math.ceil(retryAfterMs / 1000),
    // A job has no one to serve unprotected: a store failure is an error the queue retries.
    onStoreError: 'fail',
    transaction: booleanOption(name('transaction'), options.transaction, false)
  })
  return { settings, retryAfterMs, log: options.log === undefined ? SILENT : logger(name('log'), options.log) }
}

/** A runner without `log` logs nothing (decisions still reach metrics and the diagnostics channel). */
const SILENT: Logger = { debug () {}, info () {}, warn () {}, error () {}, isLevelEnabled: () => false }

const LOG_METHODS = ['debug', 'info', 'warn', 'error'] as const

function logger (name: string, value: unknown): Logger {
  const missing = missingMethods(value, LOG_METHODS)
  if (missing.length > 0) throw new InvalidOptionError(name, `a logger with ${LOG_METHODS.join(', ')} (a pino logger fits; missing ${missing.join(', ')})`, value)
  return value as Logger
}

/** One run's options over `base` (the runner's, or the plugin's). Throws InvalidOptionError naming the option. */
export function resolveRun (options: RunOptions, base: CoreSettings): ResolvedRun {
  const name = (option: string): string => `run() option "${option}"`
  if (options === null || typeof options !== 'object' || Array.isArray(options)) throw new InvalidOptionError('run() options', 'an object', options)
  for (const option of Object.keys(options)) {
    if (!RUN_OPTION_NAMES.has(option)) throw new InvalidOptionError(name(option), `one of ${[...RUN_OPTION_NAMES].join(', ')}`, (options as unknown as Record<string, unknown>)[option])
  }
  const key = text(name('key'), options.key, false)
  const operation = text(name('operation'), options.operation, false)
  const scope = options.scope === undefined ? '' : text(name('scope'), options.scope, true)
  const ttl = integerOption(name('ttl'), options.ttl, base.ttl, 1, MAX_TIMER_MS, 'milliseconds')
  const lease = options.lease === undefined ? Math.min(base.lease, ttl) : integerOption(name('lease'), options.lease, base.lease, 1, MAX_TIMER_MS, 'milliseconds')
  if (lease > ttl) throw new InvalidOptionError(name('lease'), `at most the ttl (${ttl} ms): a record must outlive its owner's lease`, lease)
  const settings: CoreSettings = {
    ...base,
    ttl,
    lease,
    wait: integerOption(name('wait'), options.wait, base.wait, 0, MAX_TIMER_MS, 'milliseconds'),
    transaction: booleanOption(name('transaction'), options.transaction, base.transaction)
  }
  return { key, operation, scope, payload: jsonOf(name('payload'), options.payload), settings }
}

/** A key, operation or scope: a string of at most MAX_NAME_LENGTH characters, without control characters (a driver cannot store a NUL). */
function text (name: string, value: unknown, emptyAllowed: boolean): string {
  // eslint-disable-next-line no-control-regex
  if (typeof value !== 'string' || (!emptyAllowed && value.length === 0) || value.length > MAX_NAME_LENGTH || /[\u0000-\u001f\u007f]/.test(value)) {
    throw new InvalidOptionError(name, `a ${emptyAllowed ? '' : 'non-empty '}string of at most ${MAX_NAME_LENGTH} characters without control characters`, value)
  }
  return value
}

/** The payload as JSON would carry it (what a queue delivers), so the fingerprint is the same on every delivery. */
function jsonOf (name: string, value: unknown): unknown {
  if (value === undefined) return undefined
  let json: string | undefined
  try {
    json = JSON.stringify(value)
  } catch (err) {
    throw new InvalidOptionError(name, `JSON-serializable (${(err as Error).message})`, value)
  }
  if (json === undefined) throw new InvalidOptionError(name, 'JSON-serializable', value)
  return JSON.parse(json)
}
