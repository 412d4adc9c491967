import type { ChildProcess } from 'node:child_process'
import path from 'node:path'
import { crashOf } from './crashes.js'
import type { PgClient } from './database.js'
import type { Attempt, AttemptOutcome, Crash, DeliveryReason, Incarnation, Operation } from './history.js'
import { killChild, sendTo, startChild } from './processes.js'
import type { Random } from './random.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The queue door: job workers (worker.ts) and the queue that feeds them, driven by the harness.
 *
 * The queue delivers at least once, as SQS's standard queues or a table polled with a visibility
 * timeout do: a delivered message is invisible for `visibilityMs`, and visible again unless its
 * consumer acknowledged it by then. So a job whose worker is killed mid-job is delivered again once
 * its visibility timeout ends (its lease has often lapsed by then: a takeover); a job slower than
 * the timeout is delivered again while the original still runs (the redelivery waits for it, then
 * replays, or gets OperationInProgressError); some messages are delivered to two workers at once;
 * and some come back once more after their acknowledgement (a duplicate after completion).
 *
 * A definite answer acknowledges the message: the job's value (a 2xx), or a refusal of a reused key
 * (KeyReusedError, 422). Anything else (OperationInProgressError, a store outage, the job's own
 * failure) makes it visible again after its Retry-After or a backoff; a worker that dies answers
 * nothing, and the message waits for its visibility timeout. Every delivery is an Attempt of the
 * job's Operation (the checker reads both doors alike), with why it was delivered.
 */

/** Evidence lines of worker N carry `instance` WORKER_INSTANCE_BASE + N, apart from the app instances'. */
export const WORKER_INSTANCE_BASE = 100

export interface QueueSettings {
  readonly workers: number
  /** New jobs a second while faults run. */
  readonly ratePerSecond: number
  /** Deliveries a worker runs at once (its prefetch). */
  readonly concurrency: number
  readonly visibilityMs: number
  /** The runner's lease: shorter than the visibility timeout, so a killed worker's key has lapsed by the time most redeliveries come. */
  readonly leaseMs: number
  /** The runner's `wait`: a duplicate waits this long for the running original before OperationInProgressError. */
  readonly waitMs: number
  /** OperationInProgressError's retryAfter: when the queue makes the message visible again. */
  readonly retryAfterMs: number
  readonly storeTimeoutMs: number
  /** Jobs that pause longer than the visibility timeout after their charge: redelivered while they run. */
  readonly slowShare: number
  readonly slowDelayMs: readonly [number, number]
  /** Messages whose first delivery goes to two workers at once. */
  readonly duplicateShare: number
  /** Messages delivered once more after their acknowledgement. */
  readonly lateDuplicateShare: number
  /** Keys reused by a producer with another amount: refused (KeyReusedError), never run. */
  readonly reuseShare: number
  readonly scopes: readonly string[]
}

/** What a worker gets for one delivery: the job and the queue's delivery id (the evidence's `req`). */
export interface Job {
  readonly scope: string
  readonly key: string
  readonly amount: number
  /** The job's pause after its charge (a slow job outlives the visibility timeout). */
  readonly delayMs: number
}
export interface JobDelivery {
  readonly delivery: number
  readonly job: Job
}

/** Settings each worker process shares. */
export interface WorkerEnvironment {
  readonly databaseUrl: string
  readonly client: PgClient
  readonly providerPort: number
  readonly settings: QueueSettings
  readonly logDir: string
  readonly now: () => number
  /** Called when a worker dies without the harness killing it (its supervisor restarts it). */
  readonly onCrash: (worker: JobWorker, crash: Omit<Crash, 'at'>) => void
}

interface PendingDelivery {
  readonly resolve: (outcome: AttemptOutcome) => void
  /** `fn` started (the worker said so): the job is mid-run, past its claim. */
  started: boolean
}

/** One worker process, supervised: killed and restarted by the faults, restarted when it dies on its own. */
export class JobWorker {
  child: ChildProcess | null = null
  readonly incarnations: Incarnation[] = []
  private readonly pending = new Map<number, PendingDelivery>()
  private stopping = false
  private starting: Promise<void> | null = null

  constructor (readonly index: number, private readonly environment: WorkerEnvironment) {}

  /** The `instance` of its evidence lines and attempts. */
  get instance (): number { return WORKER_INSTANCE_BASE + this.index }
  get evidenceFile (): string { return path.join(this.environment.logDir, `evidence-worker-${this.index}.jsonl`) }
  get running (): boolean { return this.child !== null && this.child.exitCode === null && this.child.signalCode === null }
  /** Deliveries it has not answered yet. */
  get inFlight (): number { return this.pending.size }
  /** Of those, runs whose `fn` started: what a kill interrupts mid-job. */
  get midJob (): number { return [...this.pending.values()].filter((delivery) => delivery.started).length }

  start (skewMs: number): Promise<void> {
    if (this.running) return Promise.resolve()
    this.starting ??= this.spawn(skewMs).finally(() => { this.starting = null })
    return this.starting
  }

  private async spawn (skewMs: number): Promise<void> {
    this.stopping = false
    const env = this.environment
    const s = env.settings
    const started = await startChild('test/chaos/worker.ts', {
      CHAOS_INSTANCE: String(this.instance),
      CHAOS_DATABASE_URL: env.databaseUrl,
      CHAOS_PG_CLIENT: env.client,
      CHAOS_EVIDENCE: this.evidenceFile,
      CHAOS_PROVIDER_PORT: String(env.providerPort),
      CHAOS_LEASE_MS: String(s.leaseMs),
      CHAOS_WAIT_MS: String(s.waitMs),
      CHAOS_RETRY_AFTER_MS: String(s.retryAfterMs),
      CHAOS_STORE_TIMEOUT_MS: String(s.storeTimeoutMs),
      CHAOS_CLOCK_SKEW_MS: String(skewMs)
    }, path.join(env.logDir, `worker-${this.index}.log`), ['test/chaos/clock-skew.ts'])
    const child = started.child
    this.child = child
    const incarnation: Incarnation = { instance: this.instance, pid: Number(started.ready.pid ?? child.pid), startedAt: env.now(), endedAt: null, end: null }
    this.incarnations.push(incarnation)
    child.on('message', (message: unknown) => {
      const m = message as { type?: unknown, delivery?: unknown, outcome?: AttemptOutcome } | null
      const pending = typeof m?.delivery === 'number' ? this.pending.get(m.delivery) : undefined
      if (pending === undefined) return
      if (m?.type === 'started') pending.started = true
      if (m?.type === 'result' && m.outcome !== undefined) {
        this.pending.delete(m.delivery as number)
        pending.resolve(m.outcome)
      }
    })
    child.once('exit', (code, signal) => {
      incarnation.endedAt = env.now()
      incarnation.end = this.stopping ? (signal === 'SIGKILL' ? 'killed' : 'shutdown') : 'crashed'
      if (this.child === child) this.child = null
      // What it was running dies with it; the queue hears nothing (the visibility timeout brings the message back).
      for (const [id, delivery] of this.pending) {
        this.pending.delete(id)
        delivery.resolve({ kind: 'error', error: this.stopping ? 'worker-killed' : 'worker-died' })
      }
      if (!this.stopping) env.onCrash(this, crashOf(`job worker ${this.index}`, 0, code, signal, started.stderrTail()))
    })
  }

  /** Sends one delivery; resolves with the worker's answer, or an error once the worker died. */
  deliver (delivery: JobDelivery): Promise<AttemptOutcome> {
    return new Promise((resolve) => {
      if (this.child === null || !this.running) return resolve({ kind: 'error', error: 'worker-down' })
      this.pending.set(delivery.delivery, { resolve, started: false })
      const lost = (): void => {
        if (this.pending.delete(delivery.delivery)) resolve({ kind: 'error', error: 'delivery-lost' })
      }
      if (!sendTo(this.child, { type: 'deliver', ...delivery }, lost)) lost()
    })
  }

  /** SIGKILL, mid-job: the runs die with it, their leases are left to lapse. */
  async kill (): Promise<void> {
    this.stopping = true
    if (this.child !== null) await killChild(this.child)
    this.child = null
  }
}

interface Message {
  readonly op: Operation
  readonly job: Job
  /** The producer's second message under the key, with another amount. */
  readonly reuse: boolean
  readonly producedAt: number
  visibleAt: number
  /** A definite answer came (the consumer acknowledged the message). */
  acked: boolean
  /** Drawn at production: delivered once more after the acknowledgement. */
  lateDuplicate: boolean
  /** That delivery is due or running: the message is not done until it answered. */
  lateDue: boolean
  deliveries: number
  /** The latest delivery: only its answer changes the message's visibility (an older receipt is stale). */
  latest: number
  /** Why the next delivery happens, when it is not its first nor a visibility timeout. */
  next: DeliveryReason | null
}

const done = (message: Message): boolean => message.acked && !message.lateDue

export interface QueueStats {
  readonly workers: number
  readonly jobs: number
  readonly deliveries: Readonly<Record<DeliveryReason, number>>
}

/** How long a message drawn for delivery to two workers at once waits for two of them to be up. */
const DUPLICATE_PATIENCE_MS = 3_000
const BACKOFF_BASE_MS = 50
const BACKOFF_CAP_MS = 1_000

export class JobQueue {
  readonly operations: Operation[] = []
  readonly attempts: Attempt[] = []
  private readonly messages: Message[] = []
  private deliveries = 0
  private readonly inFlight = new Set<Promise<void>>()
  private readonly reasons: Record<DeliveryReason, number> = { first: 0, visibility: 0, retry: 0, duplicate: 0, late: 0 }
  private phase: Attempt['phase'] = 'load'

  constructor (
    readonly workers: readonly JobWorker[],
    private readonly settings: QueueSettings,
    /** Draws the jobs: the same sequence for the same seed. */
    private readonly draw: Random,
    /** Worker choice and backoff, which depend on timing anyway. */
    private readonly jitter: Random,
    private readonly now: () => number,
    /** Operation ids start here, apart from the HTTP workload's. */
    private readonly firstId: number
  ) {}

  get stats (): QueueStats {
    return { workers: this.workers.length, jobs: this.operations.length, deliveries: { ...this.reasons } }
  }

  /** Messages not acknowledged yet. */
  get unfinished (): number {
    return this.messages.filter((message) => !done(message)).length
  }

  /** New jobs at the configured rate until `untilMs`, delivered as they become visible; then the answers in flight. */
  async runLoad (untilMs: number): Promise<void> {
    const startedAt = this.now()
    let produced = 0
    while (this.now() < untilMs) {
      const due = Math.floor((this.now() - startedAt) / 1000 * this.settings.ratePerSecond) - produced
      for (let i = 0; i < due; i++, produced++) this.produce()
      this.tick()
      await sleep(20)
    }
    await this.settleInFlight(untilMs + 5_000)
  }

  /** After the faults: deliveries go on until every message is acknowledged, or `untilMs`. */
  async drain (untilMs: number): Promise<void> {
    this.phase = 'drain'
    while (this.unfinished > 0 && this.now() < untilMs) {
      this.tick()
      await sleep(20)
    }
    await this.settleInFlight(untilMs)
  }

  /**
   * Jobs whose record stayed in progress although a run answered (it could not record its value):
   * delivered again, as the queue would after a lost acknowledgement, until a run answers 2xx.
   */
  async settle (ops: readonly Operation[], untilMs: number): Promise<void> {
    this.phase = 'drain'
    const ids = new Set(ops.map((op) => op.id))
    for (const message of this.messages) {
      if (message.reuse || !ids.has(message.op.id)) continue
      message.acked = false
      message.visibleAt = this.now()
      message.next = 'retry'
    }
    await this.drain(untilMs)
  }

  private async settleInFlight (untilMs: number): Promise<void> {
    while (this.inFlight.size > 0 && this.now() < untilMs) await sleep(20)
  }

  private produce (): void {
    const draw = this.draw
    const s = this.settings
    const amount = draw.int(100, 99_999)
    const op: Operation = {
      id: this.firstId + this.operations.length,
      scope: draw.pick(s.scopes),
      key: `job-${draw.hex128()}`,
      mode: 'lease',
      amount,
      reuseAmount: draw.chance(s.reuseShare) ? amount + draw.int(1, 500) : null,
      scenario: null,
      door: 'queue'
    }
    const slow = draw.chance(s.slowShare)
    const delayMs = slow ? draw.int(s.slowDelayMs[0], s.slowDelayMs[1]) : draw.int(0, 30)
    this.operations.push(op)
    this.messages.push({
      op,
      job: { scope: op.scope, key: op.key, amount, delayMs },
      reuse: false,
      producedAt: this.now(),
      visibleAt: this.now(),
      acked: false,
      lateDuplicate: draw.chance(s.lateDuplicateShare),
      lateDue: false,
      deliveries: 0,
      latest: 0,
      next: draw.chance(s.duplicateShare) ? 'duplicate' : null
    })
  }

  /** Every visible message to a worker with room for it. */
  private tick (): void {
    const now = this.now()
    for (const message of this.messages) {
      if (done(message) || message.visibleAt > now) continue
      const ready = this.workers.filter((worker) => worker.running && worker.inFlight < this.settings.concurrency)
      if (ready.length === 0) return
      const reason: DeliveryReason = message.next ?? (message.deliveries === 0 ? 'first' : 'visibility')
      // A duplicate waits (a while) for two workers to take it: one may be down after a kill.
      if (reason === 'duplicate' && ready.length < 2 && now - message.producedAt < DUPLICATE_PATIENCE_MS) continue
      message.next = null
      if (reason === 'duplicate' && ready.length >= 2) {
        // The same message to two workers at the same moment: both runs claim the key at once.
        const [a, b] = [...ready].sort(() => this.jitter() - 0.5) as [JobWorker, JobWorker]
        this.deliver(message, a, 'duplicate')
        this.deliver(message, b, 'duplicate')
      } else {
        this.deliver(message, this.jitter.pick(ready), reason === 'duplicate' ? 'first' : reason)
      }
    }
  }

  private deliver (message: Message, worker: JobWorker, reason: DeliveryReason): void {
    const id = ++this.deliveries
    const startedAt = this.now()
    message.deliveries++
    message.latest = id
    message.visibleAt = startedAt + this.settings.visibilityMs
    this.reasons[reason]++
    const phase = this.phase
    const run = worker.deliver({ delivery: id, job: message.job }).then((outcome) => {
      this.attempts.push({ op: message.op.id, reuse: message.reuse, phase, instance: worker.instance, startedAt, endedAt: this.now(), outcome, delivery: reason })
      this.answered(message, id, outcome)
    })
    this.inFlight.add(run)
    void run.finally(() => this.inFlight.delete(run))
  }

  private answered (message: Message, id: number, outcome: AttemptOutcome): void {
    if (outcome.kind === 'error') return // the worker died: the visibility timeout brings the message back
    if (message.acked) {
      // Any answer after the acknowledgement ends the late duplicate's turn (once is enough).
      if (message.lateDue && message.latest === id) message.lateDue = false
      return
    }
    const definite = message.reuse
      ? outcome.status === 422 || (outcome.status >= 200 && outcome.status < 300) // a 2xx is the checker's to report
      : outcome.status >= 200 && outcome.status < 300
    if (definite) {
      message.acked = true
      if (message.lateDuplicate) {
        message.lateDuplicate = false
        message.lateDue = true
        message.visibleAt = this.now() + this.jitter.int(100, 1_000)
        message.next = 'late'
      }
      if (!message.reuse && message.op.reuseAmount !== null && !this.messages.some((m) => m.reuse && m.op === message.op)) {
        this.messages.push({
          op: message.op,
          job: { ...message.job, amount: message.op.reuseAmount, delayMs: 0 },
          reuse: true,
          producedAt: this.now(),
          visibleAt: this.now(),
          acked: false,
          lateDuplicate: false,
          lateDue: false,
          deliveries: 0,
          latest: 0,
          next: null
        })
      }
      return
    }
    // Visible again after Retry-After or a backoff, unless a later delivery holds the message (this receipt is stale).
    if (message.latest !== id) return
    const pause = outcome.retryAfter !== null
      ? outcome.retryAfter * 1000 + this.jitter() * 100
      : this.jitter() * Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** Math.min(message.deliveries, 10))
    message.visibleAt = this.now() + pause
    message.next = 'retry'
  }
}
