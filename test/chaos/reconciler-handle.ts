import type { ChildProcess } from 'node:child_process'
import path from 'node:path'
import { crashOf } from './crashes.js'
import type { PgClient } from './database.js'
import type { Crash } from './history.js'
import { killChild, sendTo, startChild } from './processes.js'
import type { ReconcilerStats } from './reconciler.js'

/**
 * The harness's side of the reconciler worker (reconciler.ts): starts it, restarts it when it dies
 * on its own (as a process supervisor would, reporting the crash), changes its threshold, and adds
 * up the statistics of all its incarnations.
 */
export class ReconcilerHandle {
  /** False when the plugin has no reconciler (the drain's retries then resolve stuck keys alone). */
  available = false
  private child: ChildProcess | null = null
  private olderThanMs: number
  private stopping = false
  private readonly finished: ReconcilerStats = { passes: 0, examined: 0, completed: 0, resumed: 0, left: 0, errors: 0 }
  private current: ReconcilerStats = { passes: 0, examined: 0, completed: 0, resumed: 0, left: 0, errors: 0 }

  constructor (
    private readonly databaseUrl: string,
    /** The client the worker runs the store on (database.ts). */
    private readonly client: PgClient,
    private readonly intervalMs: number,
    olderThanMs: number,
    private readonly logDir: string,
    private readonly onCrash: (crash: Omit<Crash, 'at'>) => void,
    /** Where the worker logs its decisions (evidence.ts). */
    private readonly evidenceFile: string
  ) {
    this.olderThanMs = olderThanMs
  }

  get stats (): ReconcilerStats {
    const sum = { ...this.finished }
    for (const name of Object.keys(sum) as Array<keyof ReconcilerStats>) sum[name] += this.current[name]
    return sum
  }

  async start (): Promise<void> {
    const started = await startChild('test/chaos/reconciler.ts', {
      CHAOS_DATABASE_URL: this.databaseUrl,
      CHAOS_PG_CLIENT: this.client,
      CHAOS_INTERVAL_MS: String(this.intervalMs),
      CHAOS_OLDER_THAN_MS: String(this.olderThanMs),
      CHAOS_EVIDENCE: this.evidenceFile
    }, path.join(this.logDir, 'reconciler.log'))
    const child = started.child
    this.child = child
    this.available = started.ready.available === true
    child.on('message', (message: unknown) => {
      const m = message as { type?: unknown, stats?: ReconcilerStats } | null
      if (m?.type === 'stats' && m.stats !== undefined) this.current = { ...m.stats }
    })
    child.once('exit', (code, signal) => {
      if (this.child !== child) return
      this.child = null
      for (const name of Object.keys(this.finished) as Array<keyof ReconcilerStats>) this.finished[name] += this.current[name]
      this.current = { passes: 0, examined: 0, completed: 0, resumed: 0, left: 0, errors: 0 }
      if (this.stopping) return
      this.onCrash(crashOf('reconciler worker', 0, code, signal, started.stderrTail()))
      setTimeout(() => { if (!this.stopping) this.start().catch(() => {}) }, 300)
    })
  }

  /** From now on, a record counts as stuck `olderThanMs` after its lease ended. */
  setOlderThan (olderThanMs: number): void {
    this.olderThanMs = olderThanMs
    if (this.child !== null) sendTo(this.child, { type: 'older-than', ms: olderThanMs })
  }

  async stop (): Promise<void> {
    this.stopping = true
    if (this.child !== null) await killChild(this.child)
  }
}
