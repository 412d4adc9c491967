import { CLIENT_LABELS, type PgClient } from './database.js'
import type { Crash } from './history.js'

/**
 * Process deaths: app instances and reconciler workers that died without the harness killing
 * them. The target is 0 on either client, and any death fails the run (exit 1), even
 * one of a known cause: the postgres.js crash the harness used to meet (crashes.ts) is one the
 * store now avoids (drivers/postgres/dropped-connection.ts), and on node-postgres a connection
 * error with no listener is the store's to catch. A death's cause is its known cause, or else
 * the error its stderr ended with (crashes.ts, fatalError).
 */

export interface DeathCause {
  readonly cause: string
  readonly count: number
  /** Which processes died of it (with repeats: one entry per death). */
  readonly processes: readonly string[]
}

export function deathCauses (crashes: readonly Crash[]): DeathCause[] {
  const byCause = new Map<string, string[]>()
  for (const crash of crashes) {
    const cause = crash.knownCause ?? `cause unknown: ${crash.error ?? `exit ${crash.exit}, no error on stderr`}`
    byCause.set(cause, [...(byCause.get(cause) ?? []), crash.process])
  }
  return [...byCause].map(([cause, processes]) => ({ cause, count: processes.length, processes })).sort((a, b) => b.count - a.count)
}

/** The summary's headline line: the client, how many died, and of what. */
export function formatDeaths (client: PgClient, crashes: readonly Crash[]): string {
  const head = `process deaths on ${CLIENT_LABELS[client]} (died without being killed, restarted by their supervisor; target 0): ${crashes.length}`
  if (crashes.length === 0) return head
  const causes = deathCauses(crashes).map(({ cause, count, processes }) => `${count} × ${cause} (${[...new Set(processes)].join(', ')})`)
  return `${head}: ${causes.join('; ')}`
}
