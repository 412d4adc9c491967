import type { IdempotencyContext, RequestState } from './context.js'
import { checkName, deriveKey } from './derive.js'
import type { Engine } from './engine.js'
import { LeaseLostError, TransactionEndedError } from './errors.js'
import type { Fingerprint, OutboxEntry } from './store.js'
import { bounded } from './timeout.js'

/** Options of `request.idempotency.step()`. */
export interface StepOptions {
  /**
   * Run `fn` inside a store transaction (Postgres) that also records the step, so the step's
   * database writes and its record commit together: `fn` receives the transaction.
   */
  readonly transaction?: boolean
}

/**
 * `request.idempotency` of a protected request. The methods live on the prototype and the per-request
 * state stays private, so a request that never calls them pays for one small object.
 */
export class RequestContext implements IdempotencyContext {
  replayed = false
  reference: unknown = undefined
  /** Atomic mode: the open transaction (typed by the Postgres entry point's augmentation). */
  sql?: any
  readonly #engine: Engine
  readonly #state: RequestState

  constructor (
    readonly key: string,
    readonly scope: string,
    readonly fingerprint: Fingerprint,
    engine: Engine,
    state: RequestState
  ) {
    this.#engine = engine
    this.#state = state
  }

  deriveKey (name: string): string {
    return deriveKey(this.scope, this.key, name)
  }

  step<T> (name: string, fn: (transaction?: any) => T | Promise<T>, options?: StepOptions): Promise<T> {
    checkName('step', name)
    if (typeof fn !== 'function') throw new TypeError(`fastify-idempotency: step("${name}", fn) takes a function; received ${typeof fn}`)
    const state = this.#state
    const previous = state.stepChain ?? Promise.resolve()
    const run = previous.then(() => runStep(this.#engine, state, name, fn, options?.transaction === true))
    // The next step waits for this one whether it succeeds or not (its own call sees the error).
    state.stepChain = run.catch(() => {})
    return run as Promise<T>
  }

  markIndeterminate (): void {
    this.#state.lifecycle.declare('indeterminate')
  }

  markDefinite (): void {
    this.#state.lifecycle.declare('definite')
  }

  async enqueue (message: OutboxEntry, transaction: unknown = this.sql): Promise<void> {
    const store = this.#engine.store
    if (store.enqueue === undefined) throw new TypeError('fastify-idempotency: the store has no outbox (Postgres: postgresStore({ sql, outbox: { deliver } }))')
    if (transaction === undefined) {
      throw new TypeError('fastify-idempotency: enqueue() in lease mode needs the transaction of a step(name, fn, { transaction: true }): enqueue(message, tx)')
    }
    await store.enqueue(transaction, { scope: this.scope, key: this.key, name: message?.name, topic: message?.topic, payload: message?.payload })
    this.#state.enqueued = true
  }
}

/** Starts delivering what the transaction that just committed enqueued (not awaited: the response does not wait for it). */
export function deliverEnqueued (engine: Engine, state: RequestState): void {
  if (!state.enqueued) return
  state.enqueued = false
  engine.store.afterCommit?.({ scope: state.scope, key: state.key })
}

async function runStep (engine: Engine, state: RequestState, name: string, fn: (transaction?: unknown) => unknown, transactional: boolean): Promise<unknown> {
  const store = engine.store
  const lifecycle = state.lifecycle
  if (lifecycle.transactional) {
    throw new TypeError('fastify-idempotency: step() is for lease mode; in atomic mode (transaction: true) the request\'s transaction is the unit of recovery: write through request.idempotency.sql')
  }
  const lease = lifecycle.lease
  if (lifecycle.phase !== 'owner' || lease === null) {
    throw new TypeError(`fastify-idempotency: step("${name}") can only run in the handler of a request that owns its key`)
  }
  if (store.loadSteps === undefined || store.saveStep === undefined || (transactional && store.runStepInTransaction === undefined)) {
    throw new TypeError(`fastify-idempotency: the store does not record ${transactional ? 'transactional ' : ''}steps (it has no ${transactional ? 'runStepInTransaction' : 'loadSteps/saveStep'})`)
  }
  const timeout = state.settings.storeTimeout
  if (state.steps === null) {
    const loaded = await bounded('loadSteps', timeout, () => (store.loadSteps as NonNullable<typeof store.loadSteps>)(lease))
    if (loaded === null) throw new LeaseLostError(name)
    state.steps = { ...loaded }
    if (Object.keys(loaded).length > 0) lifecycle.stepCompleted()
  }
  const steps = state.steps
  if (Object.hasOwn(steps, name)) return steps[name]

  // Proved right before `fn` runs, never after: an owner that was taken over (or force-released)
  // while it waited must not run the step, since the new owner runs it (a takeover lets the
  // original complete beside the new owner; this keeps that from reaching a step). A store failure
  // propagates: nothing runs unproven.
  if (!await lifecycle.fence()) throw new LeaseLostError(name)

  let json: string | null
  if (transactional) {
    // No timeout around the whole call: it runs the step itself, which may legitimately be slow.
    try {
      json = await (store.runStepInTransaction as NonNullable<typeof store.runStepInTransaction>)(lease, name, async (tx) => await fn(tx), toJson)
    } catch (err) {
      state.enqueued = false
      // fn ended the step's transaction itself: its writes may have committed without the step's
      // record, so the step counts as having taken effect (a failure is indeterminate: the key is held).
      if (err instanceof TransactionEndedError) lifecycle.stepCompleted()
      throw err
    }
    if (json === null) state.enqueued = false
    else deliverEnqueued(engine, state)
  } else {
    const value = await fn()
    json = toJson(value)
    // The step ran: from here a failure may have left an effect behind, even if recording fails.
    lifecycle.stepCompleted()
    const saved = await bounded('saveStep', timeout, () => (store.saveStep as NonNullable<typeof store.saveStep>)(lease, name, json as string))
    if (!saved) json = null
  }
  if (json === null) throw new LeaseLostError(name)
  lifecycle.stepCompleted()
  const recorded: unknown = JSON.parse(json)
  steps[name] = recorded
  // A fresh parse, not `recorded`: the caller may mutate what it gets, the record must not change.
  return JSON.parse(json)
}

/** A step's result as recorded: JSON, with `undefined` recorded as null (JSON.stringify gives no text for it). */
function toJson (value: unknown): string {
  let json: string | undefined
  try {
    json = JSON.stringify(value)
  } catch (err) {
    throw new TypeError(`fastify-idempotency: a step's result must be JSON-serializable (${(err as Error).message})`)
  }
  return json ?? 'null'
}
