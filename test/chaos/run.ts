/**
 * The chaos harness: `tsx test/chaos/run.ts [--quick] [--duration=SECONDS] [--seed=N]
 * [--redis=standalone|cluster|both] [--instances=N] [--report=FILE] [--plant=NAME] [--scenario=NAME,...]
 * [--client=postgres|pg]`.
 *
 * Starts a private PostgreSQL, Redis and 3-master Redis Cluster, the fake provider, the reconciler
 * worker, N instances of the payments app behind fault proxies and three job workers (system.ts);
 * drives operations at them, the lease-boundary scenarios (scenarios.ts) and jobs through an
 * at-least-once queue (queue.ts), while injecting faults (clients.ts, faults.ts); stops the faults
 * and drains (retries every unanswered operation, delivers every unacknowledged job); then reads the
 * evidence logs and checks the history (checker.ts, executions.ts) and prints a summary. Exit
 * status: 0 when there is no violation, every fault kind bit often enough and every lease boundary
 * was crossed often enough, 1 on a violation (the key's history is printed) or a process death
 * (an app, job worker or reconciler that died without being killed, on either client), 2 when the harness
 * itself failed, a fault kind was not injected enough, a boundary not crossed enough or too few
 * operations ran.
 */
import { writeFileSync } from 'node:fs'
import pg from 'pg'
import { postgresStore } from '../../drivers/postgres/index.js'
import { check, keyHistory } from './checker.js'
import { Workload } from './clients.js'
import { readEvidence } from './evidence.js'
import { BOUNDARIES } from './executions.js'
import { ledgerEffects, providerLog, storedRecords } from './collect.js'
import { parseArgs, type ChaosConfig } from './config.js'
import { clientVersion } from './database.js'
import { FAULT_KINDS, FaultInjector, faultSchedule } from './faults.js'
import { recordId, type History } from './history.js'
import { killAll } from './processes.js'
import { JobQueue } from './queue.js'
import { seededRandom } from './random.js'
import { faultCounts, formatSummary, type ChaosReport } from './report.js'
import { startPrivateServices, type Services } from './services.js'
import { startSystem, type ChaosSystem } from './system.js'
import { sleep } from '../helpers/sleep.js'

/** Tries of the atomic-duplicate scenario's table lock before its operation goes on without it. */
const LOCK_TRIES = 10

/**
 * One try at the atomic-duplicate scenario's lock on the records table, held `holdMs` once taken.
 * On a node-postgres Client of its own: a database fault can end its connection between LOCK and
 * COMMIT, and postgres.js then throws from a timer when it sends the COMMIT (the nextWrite defect,
 * crashes.ts), which would end the harness; node-postgres rejects the query instead.
 */
async function holdTableLock (databaseUrl: string, holdMs: number): Promise<{ taken: boolean, released: Promise<void> }> {
  const client = new pg.Client({ connectionString: databaseUrl, application_name: 'chaos-table-lock', connectionTimeoutMillis: 2_000 })
  client.on('error', () => {}) // a fault that ends the connection: the queries below reject
  const end = (): Promise<void> => client.end().catch(() => {})
  try {
    await client.connect()
    await client.query('BEGIN')
    await client.query("SET LOCAL lock_timeout = '10ms'")
    await client.query('LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE')
  } catch {
    await end()
    return { taken: false, released: Promise.resolve() }
  }
  const released = sleep(holdMs).then(() => client.query('COMMIT')).then(end, end)
  return { taken: true, released }
}
const log = (message: string): void => { process.stderr.write(`[chaos] ${message}\n`) }

let services: Services | null = null

/** Every child and server goes, whichever way the runner ends. */
function cleanup (): void {
  killAll()
  services?.stop()
}

async function main (config: ChaosConfig): Promise<number> {
  const t0 = Date.now()
  const now = (): number => Date.now() - t0
  const random = seededRandom(config.seed)
  if (config.plant !== null) log(`PLANTED BUG: ${config.plant}; this run must find violations`)
  const targeted = config.targeted === null ? '' : ` --scenario=${config.targeted.join(',')}`
  log(`${config.targeted === null ? config.mode : 'targeted'} run on ${clientVersion(config.client)}, seed ${config.seed} (reproduce with --client=${config.client} --seed=${config.seed}${config.mode === 'quick' ? ' --quick' : ''} --duration=${config.durationS}${targeted})`)

  services = await startPrivateServices()
  log(`private services: PostgreSQL ${services.database.host}:${services.database.port} (${services.postgres.dataDir}), Redis ${services.redis.address}, cluster ${services.cluster.map((node) => node.address).join(' ')}`)
  const system = await startSystem(config, random, now, log, services)
  log(system.reconciler.available
    ? 'the store has a reconciler: a worker process runs store.reconcile() every 2 s through the database proxy'
    : 'the store has no reconciler: stuck keys are resolved by the drain\'s retries only')
  log(`services, provider and ${system.instances.length} instances up in ${(now() / 1000).toFixed(1)} s; logs in ${system.workDir}`)

  const faults = new FaultInjector({
    services,
    dbProxy: system.dbProxy,
    providerProxy: system.providerProxy,
    instances: system.instances,
    probe: system.probe,
    redisTopology: () => system.topology,
    restart: system.restart,
    workers: system.workers,
    restartWorker: system.restartWorker
  }, random.fork('injections'), now)
  // The operator's tool, on the harness's own connection (never faulted): the same statement as in production.
  const operator = postgresStore({ sql: services.postgres.sql, purgeInterval: 0 })
  const databaseUrl = services.databaseUrl
  const postgresServer = services.postgres
  const workload = new Workload(system.instances, config.workload, random.fork('operations'), random.fork('clients'), now, {
    forceRelease: (scope, key) => operator.forceRelease({ scope, key }),
    killListener: (index) => postgresServer.terminate(`chaos-app-${index} (idempotency listener)`),
    lockRecordsTable: async (holdMs) => {
      // Under load the table is seldom free of transactions for long: up to 10 tries, 20 ms apart,
      // each giving up after 10 ms in the lock's queue (where it holds up the claims behind it).
      for (let tries = 0; tries < LOCK_TRIES; tries++) {
        const lock = await holdTableLock(databaseUrl, holdMs)
        if (lock.taken) return lock
        await sleep(20)
      }
      return { taken: false, released: Promise.resolve() }
    },
    recordedSteps: async (scope, key) => {
      const record = await operator.inspect({ scope, key })
      return record === null || record.state !== 'in_progress' ? null : Object.keys(record.steps)
    }
  })
  // Job ids apart from the HTTP operations' (the checker keys attempts by operation id).
  const queue = config.queue === null ? null : new JobQueue(system.workers, config.queue, random.fork('jobs'), random.fork('deliveries'), now, 1_000_000)
  await load(config, system, faults, workload, queue, now)

  log(`healing, then draining ${workload.unanswered} unanswered operation(s)${queue === null ? '' : ` and ${queue.unfinished} unacknowledged job(s)`}`)
  await faults.heal()
  // No fault is coming: whatever is left in progress once its lease ended is stuck.
  system.reconciler.setOlderThan(0)
  const drainUntil = now() + config.drainS * 1000
  await Promise.all([workload.drain(drainUntil), queue?.drain(drainUntil)])
  // Leases of owners that died or lost their store run out, and the reconciler passes once more.
  await sleep(config.leaseMs + 2_500)
  await system.reconciler.stop()
  const settled = await settleInProgress(system, workload, queue, config, now)

  const records = await services.postgres.query((sql) => storedRecords(sql))
  const ledger = await services.postgres.query((sql) => ledgerEffects(sql))
  await system.stopProvider()
  const charges = await providerLog(system.providerLogFile)
  const history: History = {
    operations: [...workload.operations, ...queue?.operations ?? []],
    attempts: [...workload.attempts, ...queue?.attempts ?? []],
    effects: [...ledger, ...charges.effects],
    records,
    faults: faults.events,
    crashes: system.crashes,
    evidence: await readEvidence(system.evidenceFiles(), t0),
    incarnations: [...system.instances, ...system.workers].flatMap((process) => process.incarnations),
    interventions: workload.interventions
  }
  const result = check(history)
  const counts = faultCounts(faults.events)
  const faultsMissing = FAULT_KINDS.filter((kind) => counts[kind].effective < config.minEffectivePerKind)
  const crossings = result.stats.executions.boundaries
  const boundariesMissing = BOUNDARIES.filter((boundary) => crossings[boundary] < config.minCrossings[boundary])
  const tooFew = result.stats.operations < config.minOperations
  // No process may die on either client (deaths.ts); a death is a finding, like a violation.
  const died = system.crashes.length > 0
  const failed = result.violations.length > 0 || died || faultsMissing.length > 0 || boundariesMissing.length > 0 || tooFew
  const report: ChaosReport = {
    mode: config.mode,
    seed: config.seed,
    client: config.client,
    clientVersion: clientVersion(config.client),
    durationS: config.durationS,
    redis: config.redis,
    instances: config.instances,
    elapsedS: Math.round(now() / 1000),
    stats: result.stats,
    throttled: workload.throttled,
    providerCalls: charges.calls,
    providerReplays: charges.replayed,
    settledByDrain: settled,
    reconciler: system.reconciler.available ? system.reconciler.stats : null,
    faults: counts,
    faultEvents: faults.events,
    crashes: system.crashes,
    faultsMissing,
    minCrossings: config.minCrossings,
    boundariesMissing,
    scenarioOperations: scenarioCounts(workload),
    queue: queue?.stats ?? null,
    targeted: config.targeted,
    plant: config.plant,
    interventions: workload.interventions.length,
    violations: result.violations,
    logDir: failed ? system.workDir : null
  }

  process.stdout.write(formatSummary(report) + '\n')
  if (tooFew) process.stdout.write(`TOO FEW OPERATIONS: ${result.stats.operations} < ${config.minOperations}\n`)
  if (died) process.stdout.write(`PROCESS DEATHS: ${system.crashes.length} (target 0); the end of each one's stderr:\n${system.crashes.map((crash) => `${crash.process} at ${(crash.at / 1000).toFixed(1)} s (${crash.exit}):\n${crash.stderr}`).join('\n')}\n`)
  printViolations(history, result.violations)
  if (config.reportFile !== null) writeFileSync(config.reportFile, JSON.stringify(report, null, 2))
  await system.stop(!failed)
  if (failed) log(`logs kept in ${system.workDir}`)
  return result.violations.length > 0 || died ? 1 : failed ? 2 : 0
}

/** Operations at the configured rate and faults on their schedule for `durationS`; halfway, the rollover to the cluster. */
async function load (config: ChaosConfig, system: ChaosSystem, faults: FaultInjector, workload: Workload, queue: JobQueue | null, now: () => number): Promise<void> {
  const loadStart = now()
  const loadEnd = loadStart + config.durationS * 1000
  const quietMs = config.mode === 'quick' ? 3_000 : 8_000
  const schedule = faultSchedule(seededRandom(config.seed).fork('schedule'), FAULT_KINDS, config.faultsPerKind, loadStart + 2_000, loadEnd - quietMs, { 'worker-kill': config.workerKills })
  const progress = setInterval(() => {
    log(`${((now() - loadStart) / 1000).toFixed(0)} s: ${workload.operations.length} operations, ${workload.attempts.length} attempts, ${queue === null ? '' : `${queue.operations.length} jobs, ${queue.attempts.length} deliveries, `}${faults.events.length} faults`)
  }, config.mode === 'quick' ? 10_000 : 30_000)
  const rollover = config.redis !== 'both'
    ? Promise.resolve()
    : sleep(config.durationS * 500).then(() => faults.withLock('apps', async () => {
      await system.rollOverToCluster()
      log('rolled every instance over to the Redis Cluster')
    }))
  await Promise.all([workload.runLoad(loadEnd), queue?.runLoad(loadEnd), faults.run(schedule, loadEnd), rollover])
  clearInterval(progress)
  log(`load over after ${((now() - loadStart) / 1000).toFixed(1)} s`)
}

/**
 * Records still in progress although no owner is left and the reconciler had its passes: the owner
 * answered its client but could not record the response, or died after its effect. A client retry
 * takes such a key over once its lease lapsed; the drain sends that retry. Returns how many keys
 * needed it.
 */
async function settleInProgress (system: ChaosSystem, workload: Workload, queue: JobQueue | null, config: ChaosConfig, now: () => number): Promise<number> {
  const stuck = (await system.services.postgres.query((sql) => storedRecords(sql))).filter((record) => record.state !== 'completed')
  if (stuck.length === 0) return 0
  const ids = new Set(stuck.map((record) => recordId(record.scope, record.key)))
  const ops = workload.operations.filter((op) => ids.has(recordId(op.scope, op.key)))
  // A job's key is retried through its own door: delivered again, as after a lost acknowledgement.
  const jobs = queue?.operations.filter((op) => ids.has(recordId(op.scope, op.key))) ?? []
  log(`${stuck.length} record(s) still in progress after the drain; retrying their operations`)
  const until = now() + config.drainS * 1000
  await Promise.all([workload.settle(ops, until), queue?.settle(jobs, until)])
  return ops.length + jobs.length
}

function scenarioCounts (workload: Workload): ChaosReport['scenarioOperations'] {
  const counts: Record<string, number> = {}
  for (const op of workload.operations) if (op.scenario !== null) counts[op.scenario] = (counts[op.scenario] ?? 0) + 1
  return counts
}

function printViolations (history: History, violations: ChaosReport['violations']): void {
  const shown = new Set<string>()
  for (const violation of violations) {
    process.stdout.write(`VIOLATION ${violation.kind}: ${violation.message}\n`)
    const id = recordId(violation.scope, violation.key)
    if (violation.key === '' || shown.has(id) || shown.size >= 25) continue
    shown.add(id)
    process.stdout.write(keyHistory(history, violation.scope, violation.key) + '\n')
  }
}

process.on('exit', cleanup)
process.on('uncaughtException', (err) => {
  log(`harness failure (uncaught): ${err.stack ?? String(err)}`)
  process.exit(2)
})
for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) {
  process.on(signal, () => {
    log(`received ${signal}, stopping`)
    process.exit(130)
  })
}

let config: ChaosConfig
try {
  config = parseArgs(process.argv.slice(2))
} catch (err) {
  log((err as Error).message)
  process.exit(2)
}
main(config).then((code) => process.exit(code), (err: unknown) => {
  log(`harness failure: ${(err as Error).stack ?? String(err)}`)
  process.exit(2)
})
