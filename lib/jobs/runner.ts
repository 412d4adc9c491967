import { checkPrefilter, checkStore, checkTransactions } from '../core/check-store.js'
import { claimKey } from '../core/claim.js'
import { RequestState, type IdempotencyContext } from '../core/context.js'
import { closeEngine, createEngine, type Engine } from '../core/engine.js'
import { InvalidOptionError, KeyReusedError, OperationInProgressError, StoreUnavailableError } from '../core/errors.js'
import { canonicalFingerprint } from '../core/fingerprint.js'
import { resolveKeyring } from '../core/keyring.js'
import { createMetrics, observe, type Logger } from '../core/observe.js'
import { record } from '../core/outcome.js'
import { commitRecord, decide } from '../core/settle.js'
import type { CoreSettings } from '../core/settings.js'
import type { StoredResponse } from '../core/store.js'
import { resolveRun, resolveRunnerDefaults, type ResolvedRun, type RunnerOptions, type RunOptions } from './options.js'

/*
 * The job door: `run(options, fn)` runs `fn` at most once per (scope, key), through the same core
 * as a route (lib/core/claim.ts, lib/core/lifecycle.ts, lib/core/settle.ts): a redelivered job gets
 * the first run's value, a crashed worker's key is taken over once its lease lapses, steps are
 * recovery points, atomic mode commits the job's writes with its record.
 */

/** What `fn` gets: its key, its recovery points, and in atomic mode (`transaction`) the claim's transaction as `sql`. */
export type IdempotentOperation = Omit<IdempotencyContext, 'replayed' | 'reference' | 'fingerprint'>

/** A run's outcome: `fn`'s value as JSON carries it, and whether it was recorded by an earlier run (`fn` did not run). */
export interface RunResult<T> {
  readonly value: T
  readonly replayed: boolean
}

export interface IdempotencyRunner {
  /**
   * Runs `fn` once per (scope, key): a retry with the same key, operation and payload resolves the
   * first run's value with `replayed: true` without calling `fn`. Throws OperationInProgressError
   * while another run holds the key (after `wait`), KeyReusedError for another operation or
   * payload, StoreUnavailableError when the store failed (`fn` did not run); `fn`'s own error
   * propagates unchanged once the key is released (or held, after `op.markIndeterminate()` or a
   * completed step).
   */
  run<T> (options: RunOptions, fn: (op: IdempotentOperation) => T | Promise<T>): Promise<RunResult<T>>
}

/** A runner of its own, for a process without Fastify (a queue worker). */
export interface StandaloneRunner extends IdempotencyRunner {
  /** Stops background retries of settlements; the store is the caller's to close. */
  close (): Promise<void>
}

/** The state of one run: the core's, described as `RUN <operation>` to logs, metrics and the diagnostics channel. */
class RunState extends RequestState {
  readonly method = 'RUN'
  readonly request = undefined

  constructor (key: string, settings: CoreSettings, readonly route: string, readonly log: Logger) {
    super(key, settings)
  }
}

/**
 * A job runner over `options.store`, for processes without Fastify. Its options are validated here,
 * once; each run's own options when it starts.
 */
export function idempotencyRunner (options: RunnerOptions): StandaloneRunner {
  const defaults = resolveRunnerDefaults(options)
  if (options.store === undefined) throw new InvalidOptionError('idempotencyRunner() option "store"', 'an IdempotencyStore (memoryStore(), postgresStore(...))', undefined)
  checkStore(options.store, 'idempotencyRunner() option "store"')
  if (options.prefilter !== undefined) checkPrefilter(options.prefilter, 'idempotencyRunner() option "prefilter"')
  if (defaults.settings.transaction) checkTransactions(options.store, 'idempotencyRunner() option "transaction"')
  const keyring = options.encryption === undefined ? null : resolveKeyring(options.encryption)
  const engine = createEngine(options.store, options.prefilter ?? null, keyring, createMetrics(options.metrics))
  const runner = createRunner(engine, defaults.settings, defaults.retryAfterMs, defaults.log)
  return {
    run: runner.run,
    async close () { closeEngine(engine) }
  }
}

/** A runner on an engine shared with a Fastify registration (`fastify.idempotency`) or of its own. */
export function createRunner (engine: Engine, base: CoreSettings, retryAfterMs: number, log: Logger): IdempotencyRunner {
  return {
    run<T> (options: RunOptions, fn: (op: IdempotentOperation) => T | Promise<T>): Promise<RunResult<T>> {
      // A closed runner (or a closed Fastify instance) would start runs nothing settles in the background.
      if (engine.closed) return Promise.reject(new Error('fastify-idempotency: run() after the runner (or its Fastify instance) was closed'))
      let run: ResolvedRun
      try {
        run = resolveRun(options, base)
        if (typeof fn !== 'function') throw new InvalidOptionError('run() fn', 'a function (op) => value', fn)
        if (run.settings.transaction) checkTransactions(engine.store, 'run() option "transaction"')
      } catch (err) {
        return Promise.reject(err)
      }
      return runOnce(engine, run, retryAfterMs, log, fn)
    }
  }
}

async function runOnce<T> (engine: Engine, run: ResolvedRun, retryAfterMs: number, log: Logger, fn: (op: IdempotentOperation) => T | Promise<T>): Promise<RunResult<T>> {
  const state = new RunState(run.key, run.settings, run.operation, log)
  state.scope = run.scope
  // The operation stands where a route's target does: one key for two operations is two requests (422).
  const fingerprint = canonicalFingerprint('RUN', run.operation, run.payload, 'application/json')
  const decision = await claimKey(engine, state, fingerprint)
  switch (decision.kind) {
    case 'run':
      return await execute(engine, state, fn)
    case 'replay':
      return { value: replayedValue(engine, state, decision.response) as T, replayed: true }
    case 'in-progress':
      throw new OperationInProgressError(retryAfterMs)
    case 'mismatch':
      throw new KeyReusedError()
    case 'unavailable':
    case 'bypass':
    case 'preempted':
      // A run is never bypassed (onStoreError is 'fail') nor preempted (nothing answers for it).
      throw new StoreUnavailableError('the store failed or did not answer; the operation did not run', false)
  }
}

/** The run owns the key: `fn` runs, and its value is recorded (or its failure releases or holds the key). */
async function execute<T> (engine: Engine, state: RunState, fn: (op: IdempotentOperation) => T | Promise<T>): Promise<RunResult<T>> {
  const lifecycle = state.lifecycle
  const op = state.context as IdempotencyContext
  let value: T
  lifecycle.handlerStarted()
  try {
    value = await fn(op)
  } catch (err) {
    lifecycle.handlerReturned('threw')
    lifecycle.errored()
    await settleFailure(engine, state, 'threw', 'the operation threw')
    throw err
  }
  lifecycle.handlerReturned('returned')
  let json: string | undefined
  try {
    json = JSON.stringify(value)
  } catch (err) {
    // fn returned, so its effect may have happened: held (unless markDefinite), as a route's unrecordable answer is.
    observe(engine.metrics, state, 'not_recorded', 'error', 'idempotency: the operation\'s value is not JSON-serializable; it is not recorded', err)
    await settleFailure(engine, state, 'unrecordable', 'the value cannot be recorded')
    throw new TypeError(`fastify-idempotency: run()'s fn must resolve a JSON-serializable value (${(err as Error).message})`)
  }
  const response: StoredResponse = { statusCode: 200, headers: { 'content-type': 'application/json' }, body: Buffer.from(json ?? '') }
  lifecycle.respond()
  try {
    if (lifecycle.transactional) {
      const failed = await commitRecord(engine, state, response)
      if (failed !== null) throw commitError(failed.failure, failed.error)
    } else {
      await record(engine, state, response)
    }
  } finally {
    lifecycle.responded()
  }
  // The value as a replay will see it, so the first run and its retries agree.
  return { value: (json === undefined ? undefined : JSON.parse(json)) as T, replayed: false }
}

async function settleFailure (engine: Engine, state: RunState, ending: 'threw' | 'unrecordable', reason: string): Promise<void> {
  state.lifecycle.respond()
  try {
    await decide(engine, state, ending, reason)
  } finally {
    state.lifecycle.responded()
  }
}

function commitError (failure: 'not-committed' | 'transaction-ended' | 'outcome-unknown', error: unknown): Error {
  if (failure === 'outcome-unknown') {
    return new StoreUnavailableError('the commit was sent but its outcome is unknown: a retry replays the committed value or runs the operation afresh', true, error)
  }
  // Rolled back (nothing happened), or the operation ended the transaction itself (held for the reconciler): the driver's own error says which.
  return error as Error
}

/** The recorded value (JSON; empty for `undefined`). */
function replayedValue (engine: Engine, state: RunState, response: StoredResponse): unknown {
  state.lifecycle.replayed()
  if (state.context !== null) state.context.replayed = true
  if (response.body === null) {
    // Only a route records a response without its body (maxResponseBytes, a reference): the key was used by both doors.
    observe(engine.metrics, state, 'not_retained', 'error', 'idempotency: the key\'s record holds no value')
    throw new KeyReusedError()
  }
  observe(engine.metrics, state, 'replayed', 'debug', 'idempotency: returned the recorded value')
  return response.body.length === 0 ? undefined : JSON.parse(response.body.toString('utf8'))
}
