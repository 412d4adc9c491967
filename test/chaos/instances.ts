import type { ChildProcess } from 'node:child_process'
import path from 'node:path'
import { startFaultProxy, type FaultProxy } from '../helpers/fault-proxy.js'
import { crashOf } from './crashes.js'
import type { PgClient } from './database.js'
import type { Crash, Incarnation } from './history.js'
import { killChild, sendTo, shutdownChild, startChild } from './processes.js'
import type { Random } from './random.js'
import { sleep } from '../helpers/sleep.js'

/** What every app instance shares: where its database, Redis and provider are, and its timings. */
export interface InstanceEnvironment {
  /**
   * The database as the apps see it: through the database fault proxy (shared, where the
   * database faults are injected), reached through the instance's own proxy (where the harness
   * cuts that one instance off).
   */
  readonly databaseUrl: string
  readonly databaseProxy: { readonly host: string, readonly port: number }
  /** The client the store runs on (database.ts). */
  readonly client: PgClient
  readonly providerPort: number
  readonly leaseMs: number
  readonly waitMs: number
  readonly storeTimeoutMs: number
  readonly handlerDelayMs: number
  readonly logDir: string
  readonly seed: number
  /** The instance that runs without the Redis pre-filter (atomic-duplicate needs duplicates to reach the store). */
  readonly storeOnlyInstance: number
  /** Called when an instance dies without the harness killing it (its supervisor restarts it). */
  readonly onCrash: (instance: AppInstance, crash: Omit<Crash, 'at'>) => void
  /** See ChaosConfig.plant. */
  readonly plant: string | null
  /** The harness's clock (ms since the run started), for the incarnations' lifetimes. */
  readonly now: () => number
}

/**
 * One app instance: a child process behind its own fault proxy, which is what clients connect to
 * (the load balancer's view of it, the one address that stays while the process is killed and
 * started again; dropped replies and resets happen there), and with a proxy of its own in front of
 * the database proxy, which partitions this instance alone. Each process listens on a port the
 * kernel picks and reports it when ready, and the proxy follows it: a port chosen beforehand could
 * be taken by another process of the machine in between (EADDRINUSE, seen when runs overlap).
 */
export class AppInstance {
  child: ChildProcess | null = null
  /** Client attempts sent to this instance and not answered yet. */
  inFlight = 0
  skewMs = 0
  /** `standalone:<url>` or `cluster:<nodes>` (see app.ts). */
  redis: string
  starts = 0
  /** Every process this instance ran, with when it started and ended (the checker's "dead owner"). */
  readonly incarnations: Incarnation[] = []
  /** Set while the harness itself stops the process, so its exit is not a crash. */
  private stopping = false
  private starting: Promise<void> | null = null

  private constructor (
    readonly index: number,
    /** Where the proxy connects: the running process's own port (0 while no process runs). */
    private readonly upstream: { readonly host: string, port: number },
    readonly proxy: FaultProxy,
    /** Between this instance and the shared database proxy. */
    readonly dbProxy: FaultProxy,
    private readonly environment: InstanceEnvironment,
    redis: string
  ) {
    this.redis = redis
  }

  static async create (index: number, environment: InstanceEnvironment, redis: string, random: Random): Promise<AppInstance> {
    // startFaultProxy reads the target at each connection, so moving its port moves the proxy.
    const upstream = { host: '127.0.0.1', port: 0 }
    const proxy = await startFaultProxy(upstream, {}, { random })
    const dbProxy = await startFaultProxy(environment.databaseProxy, {}, { random: random.fork('db') })
    return new AppInstance(index, upstream, proxy, dbProxy, environment, redis)
  }

  /** The running process's own port (bypassing the proxy, for the harness's probes). */
  get port (): number { return this.upstream.port }

  /** Runs without the Redis pre-filter: every duplicate it gets reaches the store. */
  get storeOnly (): boolean { return this.index === this.environment.storeOnlyInstance }

  get running (): boolean {
    return this.child !== null && this.child.exitCode === null && this.child.signalCode === null
  }

  /** Starts the instance unless it runs (or is starting) already: a supervisor and a fault may both try. */
  start (skewMs: number): Promise<void> {
    if (this.running) return Promise.resolve()
    this.starting ??= this.spawn(skewMs).finally(() => { this.starting = null })
    return this.starting
  }

  private async spawn (skewMs: number): Promise<void> {
    this.skewMs = skewMs
    this.stopping = false
    const env = this.environment
    const url = new URL(env.databaseUrl)
    url.port = String(this.dbProxy.port)
    const started = await startChild('test/chaos/app.ts', {
      CHAOS_INSTANCE: String(this.index),
      CHAOS_DATABASE_URL: url.href,
      CHAOS_PG_CLIENT: env.client,
      CHAOS_EVIDENCE: path.join(env.logDir, `evidence-${this.index}.jsonl`),
      CHAOS_REDIS: this.redis,
      CHAOS_PREFILTER: this.storeOnly ? 'off' : 'on',
      CHAOS_PROVIDER_PORT: String(env.providerPort),
      CHAOS_LEASE_MS: String(env.leaseMs),
      CHAOS_WAIT_MS: String(env.waitMs),
      CHAOS_STORE_TIMEOUT_MS: String(env.storeTimeoutMs),
      CHAOS_HANDLER_DELAY_MS: String(env.handlerDelayMs),
      CHAOS_CLOCK_SKEW_MS: String(skewMs),
      CHAOS_SEED: String(env.seed),
      CHAOS_PLANT: env.plant ?? '',
      CHAOS_LOG_LEVEL: process.env.CHAOS_LOG_LEVEL ?? 'warn'
    }, path.join(env.logDir, `app-${this.index}.log`), ['test/chaos/clock-skew.ts'])
    const child = started.child
    const port = Number(started.ready.port)
    if (!Number.isInteger(port) || port <= 0) {
      await killChild(child)
      throw new Error(`chaos: app instance ${this.index} reported no port when ready (${JSON.stringify(started.ready)})`)
    }
    this.upstream.port = port
    this.child = child
    this.starts++
    const incarnation: Incarnation = { instance: this.index, pid: Number(started.ready.pid ?? child.pid), startedAt: env.now(), endedAt: null, end: null }
    this.incarnations.push(incarnation)
    child.once('exit', (code, signal) => {
      incarnation.endedAt = env.now()
      incarnation.end = this.stopping ? (signal === 'SIGKILL' ? 'killed' : 'shutdown') : 'crashed'
      if (this.child !== child) return
      this.child = null
      // Until the next start, the proxy refuses (nothing listens on port 0) instead of connecting to
      // the dead process's port, which another process may have taken meanwhile.
      this.upstream.port = 0
      if (!this.stopping) env.onCrash(this, crashOf(`app instance ${this.index}`, 0, code, signal, started.stderrTail()))
    })
  }

  /** SIGKILL: requests in flight die with it, transactions roll back, leases are left to lapse. */
  async kill (): Promise<void> {
    this.stopping = true
    if (this.child !== null) await killChild(this.child)
    this.child = null
  }

  /** A rolling deploy's stop: finish what is in flight, then exit. */
  async shutdown (): Promise<void> {
    this.stopping = true
    if (this.child !== null) await shutdownChild(this.child)
    this.child = null
  }

  /** Cuts this instance alone from the database for `ms` (its queries are held, as in a partition). */
  async partition (ms: number): Promise<void> {
    this.dbProxy.set({ blackhole: true })
    await sleep(ms)
    this.dbProxy.set({ blackhole: false })
  }

  /** Moves the instance's wall clock (clock-skew.ts) without restarting it. */
  setSkew (skewMs: number): boolean {
    if (!this.running || this.child === null || !sendTo(this.child, { type: 'clock-skew', ms: skewMs })) return false
    this.skewMs = skewMs
    return true
  }
}
