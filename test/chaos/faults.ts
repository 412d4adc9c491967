import type postgres from 'postgres'
import type { FaultProxy } from '../helpers/fault-proxy.js'
import type { FaultEvent } from './history.js'
import { get } from './http.js'
import type { AppInstance } from './instances.js'
import type { JobWorker } from './queue.js'
import type { Random } from './random.js'
import { reachable, type RedisNode, type Services } from './services.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The faults, injected at random times from a seeded schedule, each kind a bounded number of times.
 * Each injection records evidence that it bit (requests in flight when an instance died, backends
 * terminated, replies dropped, a probe query that saw the latency or the partition): a fault that
 * hit nothing proves nothing.
 */

export const FAULT_KINDS = [
  'app-kill', // SIGKILL of an instance with requests in flight, then a restart (with a new clock skew)
  'pg-terminate', // pg_terminate_backend of every app connection
  'pg-restart', // PostgreSQL stopped (fast, or immediate: a crash) and started again after a pause
  'redis-flush', // FLUSHALL on the standalone Redis and every cluster master
  'redis-restart', // the active Redis (or one cluster master) stopped, and started again after a pause
  'db-latency', // the app→database proxy delays every chunk
  'db-reset', // the app→database proxy resets every connection, and some more for a while
  'db-blackhole', // the app→database proxy forwards nothing for a while (a partition)
  'clock-skew', // a running instance's wall clock jumps by minutes
  'client-drop-reply', // an instance's proxy drops replies: the work is done, the client never hears
  'provider-drop-reply', // the app→provider proxy drops replies: the charge is made, the app never hears
  'worker-kill' // SIGKILL of a job worker mid-job (a run past its claim), then a restart
] as const

export type FaultKind = typeof FAULT_KINDS[number]

export interface FaultTargets {
  readonly services: Services
  readonly dbProxy: FaultProxy
  readonly providerProxy: FaultProxy
  readonly instances: readonly AppInstance[]
  /** A client of the harness through the database proxy, to observe what the apps see. */
  readonly probe: postgres.Sql
  /** Which Redis the apps use now. */
  readonly redisTopology: () => 'standalone' | 'cluster'
  /** Starts a stopped instance again (with a fresh clock skew). */
  readonly restart: (instance: AppInstance) => Promise<void>
  /** The queue door's workers (none in a targeted run). */
  readonly workers: readonly JobWorker[]
  readonly restartWorker: (worker: JobWorker) => Promise<void>
}

export interface ScheduledFault {
  readonly at: number
  readonly kind: FaultKind
}

/**
 * Kinds that act on the same thing run one at a time: two overlapping restarts of one server would
 * fight, and a database restart during a latency or partition would hide the probe's evidence.
 */
const GROUP: Record<FaultKind, string> = {
  'app-kill': 'apps',
  'clock-skew': 'apps-clock',
  'pg-terminate': 'pg-terminate',
  'pg-restart': 'database',
  'redis-flush': 'redis',
  'redis-restart': 'redis',
  'db-latency': 'database',
  'db-reset': 'database',
  'db-blackhole': 'database',
  'client-drop-reply': 'client-proxy',
  'provider-drop-reply': 'provider-proxy',
  'worker-kill': 'workers'
}

/** `count` of each kind (or `counts[kind]`) at uniformly random times in [fromMs, toMs], in time order. */
export function faultSchedule (random: Random, kinds: readonly FaultKind[], count: number, fromMs: number, toMs: number, counts: Partial<Record<FaultKind, number>> = {}): ScheduledFault[] {
  const schedule: ScheduledFault[] = []
  for (const kind of kinds) {
    for (let i = 0; i < (counts[kind] ?? count); i++) schedule.push({ at: Math.round(random.between(fromMs, toMs)), kind })
  }
  return schedule.sort((a, b) => a.at - b.at)
}

export class FaultInjector {
  readonly events: FaultEvent[] = []
  private readonly locks = new Map<string, Promise<unknown>>()

  constructor (
    private readonly targets: FaultTargets,
    private readonly random: Random,
    private readonly now: () => number
  ) {}

  /** Runs `fn` once every earlier holder of `group` is done. */
  withLock<T> (group: string, fn: () => Promise<T>): Promise<T> {
    const previous = this.locks.get(group) ?? Promise.resolve()
    const next = previous.then(fn, fn)
    this.locks.set(group, next.catch(() => {}))
    return next
  }

  /** Injects each scheduled fault at its time; resolves when all of them are over. */
  async run (schedule: readonly ScheduledFault[], stopAt: number): Promise<void> {
    const running: Array<Promise<void>> = []
    for (const fault of schedule) {
      const wait = fault.at - this.now()
      if (wait > 0) await sleep(wait)
      if (this.now() >= stopAt) break
      // A fault that waited for its group past the end of the load is dropped, not injected late.
      running.push(this.withLock(GROUP[fault.kind], async () => { if (this.now() < stopAt) await this.inject(fault.kind) }))
    }
    await Promise.all(running)
  }

  /** Injects one fault now and records it (a failed injection is recorded as not effective). */
  async inject (kind: FaultKind): Promise<void> {
    const at = this.now()
    let outcome: { effective: boolean, detail: string, from?: number, to?: number }
    try {
      outcome = await this.injectors[kind]()
    } catch (err) {
      outcome = { effective: false, detail: `injection failed: ${(err as Error).message}` }
    }
    this.events.push({ kind, at, ...outcome })
  }

  /** After the load: every proxy clean, every server and instance up. */
  async heal (): Promise<void> {
    const { dbProxy, providerProxy, instances, services } = this.targets
    const clean = { latencyMs: 0, resetProbability: 0, dropReplyProbability: 0, blackhole: false }
    for (const proxy of [dbProxy, providerProxy, ...instances.flatMap((instance) => [instance.proxy, instance.dbProxy])]) proxy.set(clean)
    if (!await reachable(services.database)) await this.withRetries('start PostgreSQL', () => services.postgres.start())
    for (const node of [services.redis, ...services.cluster]) {
      if (!await reachable(node.endpoint)) await this.withRetries(`start Redis ${node.address}`, () => node.start())
    }
    for (const instance of instances) if (!instance.running) await this.targets.restart(instance)
    for (const worker of this.targets.workers) if (!worker.running) await this.targets.restartWorker(worker)
  }

  private async withRetries (what: string, fn: () => Promise<void>, attempts = 5): Promise<void> {
    for (let attempt = 1; ; attempt++) {
      try {
        return await fn()
      } catch (err) {
        if (attempt >= attempts) throw new Error(`chaos: could not ${what}: ${(err as Error).message}`)
        await sleep(500)
      }
    }
  }

  /** Round trip of `select 1` through the database proxy; Infinity if it failed. */
  private async probe (timeoutMs: number): Promise<number> {
    const started = Date.now()
    try {
      await Promise.race([
        this.targets.probe`select 1`,
        sleep(timeoutMs).then(() => { throw new Error('probe timed out') })
      ])
      return Date.now() - started
    } catch (err) {
      this.lastProbeError = (err as Error).message
      return Infinity
    }
  }

  private lastProbeError = ''

  /** Until the probe's connection answers (the database may be coming back from a restart), at most 10 s. */
  private async warmProbe (): Promise<void> {
    const deadline = Date.now() + 10_000
    while (!Number.isFinite(await this.probe(2_000)) && Date.now() < deadline) await sleep(200)
  }

  private activeRedis (): RedisNode {
    const { services, redisTopology } = this.targets
    return redisTopology() === 'standalone' ? services.redis : this.random.pick(services.cluster)
  }

  /**
   * After a database fault ends, how long the apps' connections take to work again (reconnects,
   * queued queries): part of the fault's window for the checker.
   */
  private static readonly DB_SETTLE_MS = 1_000

  private readonly injectors: Record<FaultKind, () => Promise<{ effective: boolean, detail: string, from?: number, to?: number }>> = {
    'app-kill': async () => {
      const instances = this.targets.instances
      const deadline = Date.now() + 2_000
      let target: AppInstance | undefined
      while (target === undefined) {
        const busy = instances.filter((instance) => instance.running && instance.inFlight > 0).sort((a, b) => b.inFlight - a.inFlight)
        if (busy.length > 0) target = busy[0]
        else if (Date.now() > deadline) target = this.random.pick(instances.filter((instance) => instance.running))
        else await sleep(10)
      }
      const inFlight = target.inFlight
      await target.kill()
      const downMs = this.random.int(200, 1_500)
      await sleep(downMs)
      await this.targets.restart(target)
      return { effective: inFlight > 0, detail: `instance ${target.index} killed with ${inFlight} request(s) in flight, back after ${downMs} ms with clock skew ${target.skewMs} ms` }
    },

    'pg-terminate': async () => {
      const from = this.now()
      const terminated = await this.targets.services.postgres.terminate('chaos-app-')
      return { effective: terminated > 0, detail: `${terminated} app backend(s) terminated`, from, to: this.now() + FaultInjector.DB_SETTLE_MS }
    },

    'pg-restart': async () => {
      const pg = this.targets.services.postgres
      const mode = this.random.chance(0.5) ? 'immediate' : 'fast'
      const downMs = this.random.int(100, 2_000)
      const from = this.now()
      await pg.stop(mode)
      await sleep(downMs)
      await this.withRetries('start PostgreSQL', () => pg.start())
      return { effective: true, detail: `stopped (${mode}${mode === 'immediate' ? ': a crash' : ''}), started again after ${downMs} ms`, from, to: this.now() + FaultInjector.DB_SETTLE_MS }
    },

    'redis-flush': async () => {
      const { services, redisTopology } = this.targets
      const standalone = await services.redis.flushAll()
      const masters = (await Promise.all(services.cluster.map((node) => node.flushAll()))).filter(Boolean).length
      const active = redisTopology() === 'standalone' ? standalone : masters > 0
      return { effective: active, detail: `FLUSHALL: standalone ${standalone ? 'ok' : 'failed'}, ${masters}/${services.cluster.length} cluster masters (apps use ${redisTopology()})` }
    },

    'redis-restart': async () => {
      const node = this.activeRedis()
      // Below the cluster's node timeout (5 s): a short outage of one master, not a failover.
      const downMs = this.random.int(200, 2_500)
      await node.stop()
      await sleep(downMs)
      await this.withRetries(`start Redis ${node.address}`, () => node.start())
      return { effective: true, detail: `${node.clustered ? 'cluster master' : 'standalone'} ${node.address} down for ${downMs} ms` }
    },

    'db-latency': async () => {
      const proxy = this.targets.dbProxy
      const latencyMs = this.random.int(80, 400)
      const durationMs = this.random.int(1_500, 4_000)
      // On a live connection: reconnecting through the latency would take many round trips.
      await this.warmProbe()
      const from = this.now()
      proxy.set({ latencyMs })
      const started = Date.now()
      const rtt = await this.probe(durationMs)
      await sleep(Math.max(0, durationMs - (Date.now() - started)))
      proxy.set({ latencyMs: 0 })
      return { effective: Number.isFinite(rtt) && rtt >= latencyMs, detail: `+${latencyMs} ms per chunk for ${durationMs} ms (probe round trip ${rtt} ms${Number.isFinite(rtt) ? '' : ': ' + this.lastProbeError})`, from, to: this.now() + FaultInjector.DB_SETTLE_MS }
    },

    'db-reset': async () => {
      const proxy = this.targets.dbProxy
      const before = proxy.stats.resets
      const durationMs = this.random.int(1_000, 2_500)
      const from = this.now()
      proxy.resetConnections()
      proxy.set({ resetProbability: 0.03 })
      await sleep(durationMs)
      proxy.set({ resetProbability: 0 })
      const resets = proxy.stats.resets - before
      return { effective: resets > 0, detail: `${resets} connection(s) reset (all open ones, then 3% of chunks for ${durationMs} ms)`, from, to: this.now() + FaultInjector.DB_SETTLE_MS }
    },

    'db-blackhole': async () => {
      const proxy = this.targets.dbProxy
      const durationMs = this.random.int(500, 3_500)
      await this.warmProbe()
      const from = this.now()
      proxy.set({ blackhole: true })
      const probe = this.probe(durationMs + 5_000)
      await sleep(durationMs)
      proxy.set({ blackhole: false })
      const to = this.now() + FaultInjector.DB_SETTLE_MS
      const rtt = await probe
      return { effective: Number.isFinite(rtt) && rtt >= durationMs * 0.8, detail: `partition for ${durationMs} ms (probe round trip ${rtt} ms)`, from, to }
    },

    'clock-skew': async () => {
      const running = this.targets.instances.filter((instance) => instance.running)
      const instance = this.random.pick(running)
      const skewMs = (this.random.chance(0.5) ? -1 : 1) * this.random.int(30_000, 600_000)
      if (!instance.setSkew(skewMs)) return { effective: false, detail: `instance ${instance.index} not reachable over IPC` }
      await sleep(50)
      const health = await get(instance.port, '/health', 2_000)
      const seen = health.ok ? (JSON.parse(health.body) as { now: number }).now - Date.now() : NaN
      return { effective: Math.abs(seen - skewMs) < 2_000, detail: `instance ${instance.index} clock moved to ${skewMs} ms (it reports ${Number.isNaN(seen) ? '?' : seen} ms)` }
    },

    'client-drop-reply': async () => {
      const instance = this.random.pick(this.targets.instances)
      return await this.dropReplies(instance.proxy, `instance ${instance.index}'s load-balancer proxy`, 3_000)
    },

    'provider-drop-reply': async () => await this.dropReplies(this.targets.providerProxy, 'the provider proxy', 4_000),

    'worker-kill': async () => {
      // A worker with a run past its claim (fn started): its key stays taken until the lease lapses.
      const workers = this.targets.workers.filter((worker) => worker.running)
      if (workers.length === 0) return { effective: false, detail: 'no job worker running' }
      const deadline = Date.now() + 2_000
      let target: JobWorker | undefined
      while (target === undefined) {
        const busy = workers.filter((worker) => worker.running && worker.midJob > 0).sort((a, b) => b.midJob - a.midJob)
        if (busy.length > 0) target = busy[0]
        else if (Date.now() > deadline) target = this.random.pick(workers)
        else await sleep(10)
      }
      const midJob = target.midJob
      const inFlight = target.inFlight
      await target.kill()
      const downMs = this.random.int(200, 1_500)
      await sleep(downMs)
      await this.targets.restartWorker(target)
      return { effective: midJob > 0, detail: `job worker ${target.index} killed with ${midJob} job(s) mid-run (${inFlight} delivered), back after ${downMs} ms` }
    }
  }

  /** Half of the replies dropped until at least one was (or `limitMs` passed). */
  private async dropReplies (proxy: FaultProxy, where: string, limitMs: number): Promise<{ effective: boolean, detail: string }> {
    const before = proxy.stats.dropped
    const started = Date.now()
    proxy.set({ dropReplyProbability: 0.5 })
    while (proxy.stats.dropped === before && Date.now() - started < limitMs) await sleep(20)
    await sleep(this.random.int(0, 500))
    proxy.set({ dropReplyProbability: 0 })
    const dropped = proxy.stats.dropped - before
    return { effective: dropped > 0, detail: `${dropped} repl${dropped === 1 ? 'y' : 'ies'} dropped at ${where} over ${Date.now() - started} ms` }
  }
}
