import type { Attempt, AttemptOutcome, Intervention, Operation } from './history.js'
import { post, type Departure } from './http.js'
import type { AppInstance } from './instances.js'
import type { Random } from './random.js'
import { SCENARIO_ROUTES, type Scenario, type ScenarioParameters } from './scenario-routes.js'
import { runScenario, scenarioParameters, type ScenarioClient } from './scenarios.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The clients: many concurrent logical operations, each with ONE key reused for every attempt,
 * sent to a random instance each time (a load balancer), retried with exponential backoff and full
 * jitter on timeouts, connection errors and 5xx, and after Retry-After on 409 and 503 (draft §2.6).
 * Some operations start as a storm of concurrent duplicates, some re-send after their answer (to
 * collect replays), some have their key reused with a different body by a misbehaving client, and
 * some share their key string with an operation of another scope.
 *
 * Besides them, the lease-boundary scenarios (scenarios.ts) start one operation every
 * `scenarioIntervalMs`, each scenario in turn, so every one of them runs about as often.
 */

export interface WorkloadSettings {
  readonly scopes: readonly string[]
  readonly ratePerSecond: number
  readonly maxConcurrent: number
  readonly attemptTimeoutMs: number
  /** Attempts an operation makes while faults run before its client gives up (the drain retries it). */
  readonly maxAttempts: number
  readonly atomicShare: number
  readonly reuseShare: number
  readonly sharedKeyShare: number
  readonly stormShare: number
  readonly replayCheckShare: number
  /** The lease-boundary scenarios this run drives, in turn (none: only the payments above). */
  readonly scenarios: readonly Scenario[]
  readonly scenarioIntervalMs: number
}

/** What the workload asks of the harness for the scenarios. */
export interface WorkloadHooks {
  /** `store.forceRelease` on the harness's own store: true when an in-progress record was deleted. */
  readonly forceRelease: (scope: string, key: string) => Promise<boolean>
  /** The names of the steps recorded on the key's in-progress record (`store.inspect`), or null. */
  readonly recordedSteps: (scope: string, key: string) => Promise<string[] | null>
  /**
   * Locks the records table for `holdMs` when it can be taken within 10 ms, tried a few times (a
   * lock queued behind a long transaction would block every claim for as long: DDL during traffic,
   * not a moment's lock). Resolves once it holds the lock (true) or gave up (false); it is released
   * `holdMs` later.
   */
  readonly lockRecordsTable: (holdMs: number) => Promise<{ taken: boolean, released: Promise<void> }>
  /** Terminates the settlement listener connection of app instance `index`; how many were terminated. */
  readonly killListener: (index: number) => Promise<number>
}

interface OperationState {
  answered: boolean
  reuseRefused: boolean
}

const BACKOFF_BASE_MS = 50
const BACKOFF_CAP_MS = 1_000

export class Workload {
  readonly operations: Operation[] = []
  readonly attempts: Attempt[] = []
  /** Force releases and partitions the scenarios made. */
  readonly interventions: Intervention[] = []
  /** Operations the load phase could not start because maxConcurrent were already running. */
  throttled = 0
  private readonly states = new Map<number, OperationState>()
  private readonly keysByScope = new Map<string, Set<string>>()
  private active = 0
  private readonly parameters = new Map<number, ScenarioParameters>()
  /** Draws the scenario operations, apart from `draw`: the payments' sequence is the same with or without them. */
  private readonly scenarioDraw: Random

  constructor (
    private readonly instances: readonly AppInstance[],
    private readonly settings: WorkloadSettings,
    /** Draws the operations: the same sequence for the same seed. */
    private readonly draw: Random,
    /** Instance choice and jitter, which depend on timing anyway. */
    private readonly jitter: Random,
    private readonly now: () => number,
    private readonly hooks: WorkloadHooks
  ) {
    this.scenarioDraw = draw.fork('scenarios')
  }

  /** Starts operations at the configured rate until `untilMs`, then waits for them (they stop retrying at `untilMs`). */
  async runLoad (untilMs: number): Promise<void> {
    const startedAt = this.now()
    const running = new Set<Promise<void>>()
    let started = 0
    let scenariosStarted = 0
    // The last scenario starts early enough to reach its boundary before the faults stop.
    const scenariosUntil = untilMs - 3_000
    // steps-partition twice a turn: a third of its partitions meet an owner that a fault already
    // took out (a failed claim, a kill), and each takes only one boundary with it. atomic-duplicate
    // twice too: it needs the one instance without a pre-filter, which faults take down at times.
    const rotation = this.settings.scenarios.flatMap((scenario) => scenario === 'steps-partition' || scenario === 'atomic-duplicate' ? [scenario, scenario] : [scenario])
    while (this.now() < untilMs) {
      while (rotation.length > 0 && this.now() < scenariosUntil && this.now() - startedAt >= scenariosStarted * this.settings.scenarioIntervalMs) {
        const scenario = rotation[scenariosStarted % rotation.length] as Scenario
        scenariosStarted++
        const run = this.runScenarioOperation(this.newScenarioOperation(scenario), untilMs)
        running.add(run)
        void run.finally(() => running.delete(run))
      }
      const due = Math.floor((this.now() - startedAt) / 1000 * this.settings.ratePerSecond) - started
      for (let i = 0; i < due; i++) {
        started++
        if (this.active >= this.settings.maxConcurrent) {
          this.throttled++
          continue
        }
        const run = this.runOperation(this.newOperation(), untilMs)
        running.add(run)
        void run.finally(() => running.delete(run))
      }
      await sleep(20)
    }
    await Promise.all(running)
  }

  /** After the faults: every operation without a 2xx, and every reused key not yet refused, retried until answered. */
  async drain (untilMs: number, concurrency = 16): Promise<void> {
    const work: Array<() => Promise<void>> = []
    for (const op of this.operations) {
      const state = this.stateOf(op)
      if (!state.answered) {
        work.push(async () => {
          await this.untilAnswered(op, 'drain', untilMs, Infinity)
          if (op.reuseAmount !== null && this.stateOf(op).answered) await this.untilRefused(op, 'drain', untilMs, Infinity)
        })
      } else if (op.reuseAmount !== null && !state.reuseRefused) {
        work.push(() => this.untilRefused(op, 'drain', untilMs, Infinity))
      }
    }
    const workers = Array.from({ length: concurrency }, async () => {
      for (let next = work.shift(); next !== undefined; next = work.shift()) await next()
    })
    await Promise.all(workers)
  }

  /**
   * Operations whose record stayed in progress although their client had its answer (the owner
   * could not record it): retried as a client would, so the key is taken over once its lease
   * lapsed and the outcome recorded. Resolves when each got a 2xx again, or at `untilMs`.
   */
  async settle (ops: readonly Operation[], untilMs: number, concurrency = 16): Promise<void> {
    const work = [...ops]
    const workers = Array.from({ length: concurrency }, async () => {
      for (let op = work.shift(); op !== undefined; op = work.shift()) {
        for (let n = 0; this.now() < untilMs; n++) {
          const outcome = await this.send(op, false, 'drain')
          if (outcome.kind === 'response' && outcome.status >= 200 && outcome.status < 300) break
          await this.pause(outcome, n)
        }
      }
    })
    await Promise.all(workers)
  }

  /** Operations still without a 2xx. */
  get unanswered (): number {
    return this.operations.filter((op) => !this.stateOf(op).answered).length
  }

  private newOperation (): Operation {
    const draw = this.draw
    const scope = draw.pick(this.settings.scopes)
    const keys = this.keysByScope.get(scope) ?? new Set<string>()
    this.keysByScope.set(scope, keys)
    let key = `op-${draw.hex128()}`
    if (draw.chance(this.settings.sharedKeyShare)) {
      // The same key string in another scope is another operation (draft §5): both must execute.
      // Never a scenario's key: its prefix routes it (the reconciler's policy reads it).
      const other = this.operations.findLast((op) => op.scenario === null && op.scope !== scope && !keys.has(op.key))
      if (other !== undefined) key = other.key
    }
    keys.add(key)
    const amount = draw.int(100, 99_999)
    const op: Operation = {
      id: this.operations.length,
      scope,
      key,
      mode: draw.chance(this.settings.atomicShare) ? 'atomic' : 'lease',
      amount,
      reuseAmount: draw.chance(this.settings.reuseShare) ? amount + draw.int(1, 500) : null,
      scenario: null
    }
    this.operations.push(op)
    this.states.set(op.id, { answered: false, reuseRefused: false })
    return op
  }

  private newScenarioOperation (scenario: Scenario): Operation {
    const draw = this.scenarioDraw
    const scope = draw.pick(this.settings.scopes)
    const key = `${scenario}-${draw.hex128()}`
    // Registered, so a payment sharing a key string across scopes never lands on this one's (scope, key).
    const keys = this.keysByScope.get(scope) ?? new Set<string>()
    this.keysByScope.set(scope, keys)
    keys.add(key)
    const op: Operation = {
      id: this.operations.length,
      scope,
      key,
      mode: SCENARIO_ROUTES[scenario].mode,
      amount: draw.int(100, 99_999),
      reuseAmount: null,
      scenario
    }
    this.parameters.set(op.id, scenarioParameters(scenario, draw))
    this.operations.push(op)
    this.states.set(op.id, { answered: false, reuseRefused: false })
    return op
  }

  private async runScenarioOperation (op: Operation, untilMs: number): Promise<void> {
    const client: ScenarioClient = {
      instances: this.instances,
      jitter: this.jitter,
      attempt: async (target, options) => {
        const outcome = await this.send(target, false, 'load', options)
        if (outcome.kind === 'response' && outcome.status >= 200 && outcome.status < 300) this.stateOf(target).answered = true
        return outcome
      },
      untilAnswered: (target, options) => this.untilAnswered(target, 'load', untilMs, options.maxAttempts ?? this.settings.maxAttempts, options),
      untilStepRecorded: async (target, name, timeoutMs) => {
        const deadline = this.now() + timeoutMs
        while (this.now() < deadline) {
          const steps = await this.hooks.recordedSteps(target.scope, target.key).catch(() => null)
          if (steps?.includes(name) === true) return true
          await sleep(25)
        }
        return false
      },
      forceRelease: async (target) => {
        const from = this.now()
        let effective = false
        try {
          effective = await this.hooks.forceRelease(target.scope, target.key)
        } catch {}
        this.interventions.push({ kind: 'force-release', scope: target.scope, key: target.key, from, to: this.now(), instance: null, effective })
      },
      lockRecordsTable: async (target, holdMs) => {
        const from = this.now()
        const lock = await this.hooks.lockRecordsTable(holdMs)
        void lock.released.then(() => {
          this.interventions.push({ kind: 'table-lock', scope: target.scope, key: target.key, from, to: this.now(), instance: null, effective: lock.taken })
        })
        return lock.taken
      },
      killListener: async (instance, target) => {
        const from = this.now()
        let killed = 0
        try {
          killed = await this.hooks.killListener(instance.index)
        } catch {}
        this.interventions.push({ kind: 'listener-kill', scope: target.scope, key: target.key, from, to: this.now(), instance: instance.index, effective: killed > 0 })
      },
      partition: async (instance, target, ms) => {
        const from = this.now()
        await instance.partition(ms)
        this.interventions.push({ kind: 'partition', scope: target.scope, key: target.key, from, to: this.now(), instance: instance.index, effective: true })
      }
    }
    try {
      await runScenario(op.scenario as Scenario, op, client)
    } catch {}
  }

  private stateOf (op: Operation): OperationState {
    return this.states.get(op.id) as OperationState
  }

  private async runOperation (op: Operation, untilMs: number): Promise<void> {
    this.active++
    try {
      const copies = this.draw.chance(this.settings.stormShare) ? this.draw.int(2, 4) : 1
      const replayChecks = this.draw.chance(this.settings.replayCheckShare) ? this.draw.int(1, 2) : 0
      await Promise.all(Array.from({ length: copies }, () => this.untilAnswered(op, 'load', untilMs, this.settings.maxAttempts)))
      if (!this.stateOf(op).answered) return
      for (let i = 0; i < replayChecks && this.now() < untilMs; i++) await this.send(op, false, 'load')
      if (op.reuseAmount !== null) await this.untilRefused(op, 'load', untilMs, this.settings.maxAttempts)
    } finally {
      this.active--
    }
  }

  private async untilAnswered (op: Operation, phase: Attempt['phase'], untilMs: number, maxAttempts: number, options: { avoid?: AppInstance, impatient?: boolean } = {}): Promise<void> {
    const state = this.stateOf(op)
    for (let n = 0; !state.answered && n < maxAttempts && this.now() < untilMs; n++) {
      const others = options.avoid === undefined ? [] : this.instances.filter((instance) => instance !== options.avoid && instance.running)
      const outcome = await this.send(op, false, phase, others.length > 0 ? { instance: this.jitter.pick(others) } : {})
      if (outcome.kind === 'response' && outcome.status >= 200 && outcome.status < 300) {
        state.answered = true
        return
      }
      if (state.answered) return
      await (options.impatient === true ? sleep(150 + this.jitter() * 150) : this.pause(outcome, n))
    }
  }

  /** The misbehaving client: same key, different amount, until the API refuses it (422). */
  private async untilRefused (op: Operation, phase: Attempt['phase'], untilMs: number, maxAttempts: number): Promise<void> {
    const state = this.stateOf(op)
    for (let n = 0; !state.reuseRefused && n < maxAttempts && this.now() < untilMs; n++) {
      const outcome = await this.send(op, true, phase)
      if (outcome.kind === 'response' && (outcome.status === 422 || (outcome.status >= 200 && outcome.status < 300))) {
        // A 2xx here is a violation the checker reports; retrying would not make it less of one.
        state.reuseRefused = outcome.status === 422
        return
      }
      await this.pause(outcome, n)
    }
  }

  private pause (outcome: AttemptOutcome, attempt: number): Promise<void> {
    if (outcome.kind === 'response' && outcome.retryAfter !== null) {
      return sleep(outcome.retryAfter * 1000 + this.jitter() * 250)
    }
    return sleep(this.jitter() * Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** attempt))
  }

  private async send (op: Operation, reuse: boolean, phase: Attempt['phase'], options: { instance?: AppInstance, departure?: Departure } = {}): Promise<AttemptOutcome> {
    const instance = options.instance ?? this.jitter.pick(this.instances)
    const body = JSON.stringify({ amount: reuse ? op.reuseAmount : op.amount, currency: 'EUR', ...this.parameters.get(op.id) })
    const headers = {
      'content-type': 'application/json',
      'idempotency-key': `"${op.key}"`,
      'x-account': op.scope
    }
    const startedAt = this.now()
    instance.inFlight++
    const result = await post(instance.proxy.port, pathOf(op), headers, body, this.settings.attemptTimeoutMs, options.departure)
    instance.inFlight--
    const outcome: AttemptOutcome = result.ok
      ? {
          kind: 'response',
          status: result.status,
          replayed: result.headers['idempotent-replayed'] === 'true',
          body: result.body,
          retryAfter: retryAfterOf(result.status, result.headers['retry-after'])
        }
      : { kind: 'error', error: result.error }
    this.attempts.push({ op: op.id, reuse, phase, instance: instance.index, startedAt, endedAt: this.now(), outcome })
    return outcome
  }
}

function pathOf (op: Operation): string {
  if (op.scenario !== null) return SCENARIO_ROUTES[op.scenario].path
  return op.mode === 'atomic' ? '/payments/atomic' : '/payments/lease'
}

/** Retry-After in seconds (RFC 9110 §10.2.3, delay-seconds form), on the statuses that carry it here. */
function retryAfterOf (status: number, header: string | string[] | undefined): number | null {
  if ((status !== 409 && status !== 503) || typeof header !== 'string') return null
  const seconds = Number(header)
  return Number.isFinite(seconds) && seconds >= 0 ? seconds : null
}
