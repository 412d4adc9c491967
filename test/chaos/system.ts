import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import postgres from 'postgres'
import { migrate } from '../../drivers/postgres/index.js'
import { startFaultProxy, type FaultProxy } from '../helpers/fault-proxy.js'
import { LEDGER_DDL } from './collect.js'
import type { ChaosConfig } from './config.js'
import type { Crash } from './history.js'
import { AppInstance } from './instances.js'
import { killChild, startChild, type Started } from './processes.js'
import { JobWorker } from './queue.js'
import type { Random } from './random.js'
import { ReconcilerHandle } from './reconciler-handle.js'
import type { Services } from './services.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The system under test, wired on loopback:
 *
 *   clients → [fault proxy per instance] → app instances ×N → [partition proxy per instance] → [database fault proxy] → PostgreSQL
 *                                               │  └──────────→ Redis (standalone, later the cluster)
 *                                               └→ [provider fault proxy] → fake provider
 *   reconciler worker → [database fault proxy] → PostgreSQL
 *   harness's job queue → job workers ×3 → [database fault proxy] → PostgreSQL; → [provider fault proxy]
 *
 * Database faults act on the shared database proxy (every instance and the reconciler see them);
 * a scenario cuts one instance off at its own partition proxy.
 *
 * Every process is supervised: one that dies without being killed is reported as a crash and
 * restarted (as systemd or Kubernetes would).
 */
export interface ChaosSystem {
  readonly services: Services
  /** Logs of the instances, the provider and the reconciler (kept when the run fails). */
  readonly workDir: string
  readonly providerLogFile: string
  /** The instances' and the reconciler's evidence logs (evidence.ts). */
  readonly evidenceFiles: () => string[]
  readonly dbProxy: FaultProxy
  readonly providerProxy: FaultProxy
  readonly instances: readonly AppInstance[]
  /** The queue door's job workers (none in a targeted run). */
  readonly workers: readonly JobWorker[]
  /** A client of the harness through the database proxy, to observe what the apps see. */
  readonly probe: postgres.Sql
  readonly reconciler: ReconcilerHandle
  readonly crashes: readonly Crash[]
  /** Which Redis the instances use now. */
  readonly topology: 'standalone' | 'cluster'
  /** Starts a stopped instance again, with a fresh clock skew. */
  restart (instance: AppInstance): Promise<void>
  /** Starts a stopped job worker again, with a fresh clock skew. */
  restartWorker (worker: JobWorker): Promise<void>
  /** A rolling deploy onto the Redis Cluster: one instance at a time, in-flight requests finish first. */
  rollOverToCluster (): Promise<void>
  /** Stops the provider (its log is then complete). */
  stopProvider (): Promise<void>
  /** Everything the harness started, except the services (stopped by their own exit handler). */
  stop (removeWorkDir: boolean): Promise<void>
}

export async function startSystem (config: ChaosConfig, random: Random, now: () => number, log: (message: string) => void, services: Services): Promise<ChaosSystem> {
  const workDir = mkdtempSync(path.join(tmpdir(), 'idem-chaos-'))
  await services.postgres.query(async (sql) => {
    await migrate(sql)
    await sql.unsafe(LEDGER_DDL)
  })

  const providerLogFile = path.join(workDir, 'provider.jsonl')
  const provider: Started = await startChild('test/chaos/provider.ts', { CHAOS_PROVIDER_LOG: providerLogFile, CHAOS_SEED: String(config.seed) }, path.join(workDir, 'provider.log'))
  const providerProxy = await startFaultProxy({ host: '127.0.0.1', port: Number(provider.ready.port) }, {}, { random: random.fork('provider-proxy') })
  const dbProxy = await startFaultProxy(services.database, {}, { random: random.fork('db-proxy') })
  const proxiedUrl = new URL(services.databaseUrl)
  proxiedUrl.port = String(dbProxy.port)
  // connect_timeout above the longest partition, so a probe that must reconnect sees it heal;
  // fetch_types: false for the reason given in app.ts.
  const probe = postgres(proxiedUrl.href, { max: 1, connect_timeout: 10, fetch_types: false, onnotice: () => {}, connection: { application_name: 'chaos-probe' } })

  const crashes: Crash[] = []
  let finishing = false
  const recordCrash = (crash: Omit<Crash, 'at'>): void => {
    crashes.push({ ...crash, at: now() })
    log(`${crash.process} died on its own (${crash.exit}): ${crash.knownCause ?? 'cause unknown'}`)
  }
  // A record counts as stuck two leases after its lease ended: by then a live client has retried.
  const reconcilerEvidence = path.join(workDir, 'evidence-reconciler.jsonl')
  const reconciler = new ReconcilerHandle(proxiedUrl.href, config.client, 2_000, 2 * config.leaseMs, workDir, recordCrash, reconcilerEvidence)
  await reconciler.start()

  let topology: 'standalone' | 'cluster' = config.redis === 'cluster' ? 'cluster' : 'standalone'
  const redisOf = (which: 'standalone' | 'cluster'): string => which === 'cluster'
    ? `cluster:${services.cluster.map((node) => node.address).join(',')}`
    : `standalone:redis://${services.redis.address}`
  const skews = random.fork('clock-skews')
  // Most instances run with their clock minutes off; the store uses the database clock.
  const skew = (): number => skews.chance(0.25) ? 0 : (skews.chance(0.5) ? -1 : 1) * skews.int(1_000, 300_000)
  const restart = async (instance: AppInstance): Promise<void> => {
    for (let attempt = 1; ; attempt++) {
      try {
        return await instance.start(skew())
      } catch (err) {
        if (attempt >= 3) throw err
        await sleep(500)
      }
    }
  }
  const environment = {
    databaseUrl: proxiedUrl.href,
    databaseProxy: { host: '127.0.0.1', port: dbProxy.port },
    client: config.client,
    now,
    providerPort: providerProxy.port,
    leaseMs: config.leaseMs,
    waitMs: config.waitMs,
    storeTimeoutMs: config.storeTimeoutMs,
    handlerDelayMs: 30,
    // The last instance: the others keep the pre-filter that the Redis faults act on.
    storeOnlyInstance: config.instances - 1,
    logDir: workDir,
    seed: config.seed,
    plant: config.plant,
    onCrash: (instance: AppInstance, crash: Omit<Crash, 'at'>) => {
      recordCrash(crash)
      setTimeout(() => { if (!finishing) restart(instance).catch(() => {}) }, 300)
    }
  }
  const instances = await Promise.all(Array.from({ length: config.instances }, (_, i) =>
    AppInstance.create(i, environment, redisOf(topology), random.fork(`lb-proxy-${i}`))))
  await Promise.all(instances.map((instance) => restart(instance)))

  // The queue door's workers: through the database proxy (the database faults reach them), without
  // an instance's partition proxy, and on the provider proxy, as the apps.
  const restartWorker = async (worker: JobWorker): Promise<void> => {
    for (let attempt = 1; ; attempt++) {
      try {
        return await worker.start(skew())
      } catch (err) {
        if (attempt >= 3) throw err
        await sleep(500)
      }
    }
  }
  const queue = config.queue
  const workers = queue === null
    ? []
    : Array.from({ length: queue.workers }, (_, i) => new JobWorker(i, {
      databaseUrl: proxiedUrl.href,
      client: config.client,
      providerPort: providerProxy.port,
      settings: queue,
      logDir: workDir,
      now,
      onCrash: (worker: JobWorker, crash: Omit<Crash, 'at'>) => {
        recordCrash(crash)
        setTimeout(() => { if (!finishing) restartWorker(worker).catch(() => {}) }, 300)
      }
    }))
  await Promise.all(workers.map((worker) => restartWorker(worker)))

  return {
    services,
    workDir,
    providerLogFile,
    evidenceFiles: () => [reconcilerEvidence, ...instances.map((instance) => path.join(workDir, `evidence-${instance.index}.jsonl`)), ...workers.map((worker) => worker.evidenceFile)],
    dbProxy,
    providerProxy,
    instances,
    workers,
    probe,
    reconciler,
    crashes,
    get topology () { return topology },
    restart,
    restartWorker,
    async rollOverToCluster () {
      for (const instance of instances) {
        await instance.shutdown()
        instance.redis = redisOf('cluster')
        await restart(instance)
      }
      topology = 'cluster'
    },
    async stopProvider () {
      await killChild(provider.child)
    },
    async stop (removeWorkDir: boolean) {
      finishing = true
      await reconciler.stop()
      await Promise.all([...instances, ...workers].map((process) => process.kill()))
      await killChild(provider.child)
      await Promise.all([dbProxy, providerProxy, ...instances.flatMap((instance) => [instance.proxy, instance.dbProxy])].map((proxy) => proxy.close()))
      await probe.end({ timeout: 1 })
      await services.postgres.close()
      if (removeWorkDir) rmSync(workDir, { recursive: true, force: true })
    }
  }
}
