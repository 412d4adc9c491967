/**
 * The reconciler worker: its own process (as it would be deployed), running the store's `reconcile`
 * pass every CHAOS_INTERVAL_MS with the app's policy (reconcile-policy.ts), through the database
 * proxy, so it meets the same faults as the apps, and the harness restarts it when it dies.
 *
 * Its own loop rather than `store.startReconciler`: the harness changes the pass's threshold while
 * it runs (`older-than`), and startReconciler's options are fixed when it starts. One worker runs,
 * so the store's advisory lock has nothing to exclude.
 * The same loop on node-postgres (CHAOS_PG_CLIENT=pg, database.ts), so both clients' runs do the
 * same work.
 *
 * Run as `node --import tsx test/chaos/reconciler.ts` with an IPC channel and CHAOS_DATABASE_URL.
 * Sends `{ type: 'ready', available }` (false when the plugin has no reconciler) and
 * `{ type: 'stats', stats }` after every pass; `{ type: 'older-than', ms }` changes its threshold;
 * it exits when the channel closes.
 */
import { postgresStore } from '../../drivers/postgres/index.js'
import { openDatabase, pgClientFromEnv } from './database.js'
import { evidenceLog } from './evidence.js'
import { resolveStuck, type Resolution, type StuckRecordView } from './reconcile-policy.js'
import { sleep } from '../helpers/sleep.js'

export interface ReconcilerStats {
  passes: number
  examined: number
  completed: number
  resumed: number
  /** Left for a later pass (a held record of the `held` scenario, younger than HELD_MIN_MS). */
  left: number
  errors: number
}

interface PassReport {
  readonly examined: number
  readonly completed: number
  readonly resumed: number
  readonly left?: number
  readonly errors: readonly unknown[]
}

/** The part of the store's recovery API used here, typed locally so the harness builds without it. */
interface ReconcilingStore {
  reconcile (options: { resolve: (record: StuckRecordView) => Resolution, olderThan: number, lease: number, limit: number }): Promise<PassReport>
}

const url = process.env.CHAOS_DATABASE_URL
const evidenceFile = process.env.CHAOS_EVIDENCE
if (url === undefined || evidenceFile === undefined || process.send === undefined) throw new Error('reconciler: CHAOS_DATABASE_URL, CHAOS_EVIDENCE and an IPC channel are required')
const log = evidenceLog(evidenceFile, -1)
const intervalMs = Number(process.env.CHAOS_INTERVAL_MS ?? '2000')
let olderThanMs = Number(process.env.CHAOS_OLDER_THAN_MS ?? '4000')

// On the apps' client (CHAOS_PG_CLIENT), with the apps' settings; the pg-terminate fault reaches it by its name.
const database = openDatabase(pgClientFromEnv(process.env.CHAOS_PG_CLIENT), { url, max: 2, applicationName: 'chaos-app-reconciler' })
const store = postgresStore({ ...database.connection, purgeInterval: 0 }) as unknown as Partial<ReconcilingStore>
const stats: ReconcilerStats = { passes: 0, examined: 0, completed: 0, resumed: 0, left: 0, errors: 0 }

/** The policy's decision, logged before the store applies it: the checker's end of a hold. */
function decide (record: StuckRecordView): Resolution {
  const resolution = resolveStuck(record)
  log({ ev: 'resolve', scope: record.scope, key: record.key, action: resolution.action })
  return resolution
}

async function pass (reconcile: NonNullable<ReconcilingStore['reconcile']>): Promise<void> {
  try {
    const report = await reconcile.call(store, { resolve: decide, olderThan: olderThanMs, lease: 10_000, limit: 200 })
    stats.passes++
    stats.examined += report.examined
    stats.completed += report.completed
    stats.resumed += report.resumed
    stats.left += report.left ?? 0
    stats.errors += report.errors.length
  } catch {
    stats.errors++
  }
  process.send?.({ type: 'stats', stats })
}

async function loop (): Promise<void> {
  const reconcile = store.reconcile
  if (reconcile === undefined) return
  for (;;) {
    await sleep(intervalMs)
    await pass(reconcile)
  }
}

process.on('message', (message: unknown) => {
  const m = message as { type?: unknown, ms?: unknown } | null
  if (m?.type === 'older-than' && typeof m.ms === 'number') olderThanMs = m.ms
})
process.on('disconnect', () => process.exit(0))

process.send({ type: 'ready', available: store.reconcile !== undefined })
void loop()
