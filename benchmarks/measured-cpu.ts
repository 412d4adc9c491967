/**
 * The CPU the measured side spends per request: the benchmark server's process plus every
 * PostgreSQL and Redis process on the machine, user + system time from /proc/<pid>/stat, summed
 * over a measured window (run.ts and crosscheck.ts, issue 14).
 *
 * Why: on a machine whose cores the load generator shares with what it measures, req/s between a
 * setup bounded by the server's CPU (bare) and one bounded by a backend's round trips (pg-lease
 * under the storm) depends on the CPU the generator takes per request, and autocannon and wrk
 * take different amounts. The measured side's CPU per request does not count the generator's, so
 * "requests per CPU-second of the measured side", taken as a ratio between two setups, is the
 * figure two different generators can agree on: the throughput ratio the setups would have if the
 * generator were free and the measured side had the cores to itself.
 *
 * It counts background work too (PostgreSQL's WAL writer and checkpointer, Redis's cron), which is
 * part of what a request costs. A process that starts or ends inside the window is counted from
 * the sample it appears in, so the windows are taken on long-lived processes: the server's pool
 * connects before its warm-up. Null off Linux (no /proc).
 */
import { readdirSync, readFileSync } from 'node:fs'

/** /proc reports CPU times in USER_HZ ticks, which the kernel's ABI fixes at 100 per second. */
const TICK_MS = 10

/** The measured side's CPU so far, ms: the server's process, every PostgreSQL process, every Redis process. */
export interface CpuSplit { server: number, postgres: number, redis: number }

/** CPU time so far, ms, of the process `serverPid` and of every PostgreSQL and Redis process, apart; null off Linux. */
export function measuredCpuSplitMs (serverPid: number): CpuSplit | null {
  if (process.platform !== 'linux') return null
  const ticks = { server: 0, postgres: 0, redis: 0 }
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue
    let stat: string
    try { stat = readFileSync(`/proc/${entry}/stat`, 'utf8') } catch { continue } // gone since readdir
    // `pid (comm) state …`: comm may hold spaces or parentheses, so split after the last ')'
    const close = stat.lastIndexOf(')')
    const comm = stat.slice(stat.indexOf('(') + 1, close)
    const which = Number(entry) === serverPid ? 'server' : comm === 'postgres' ? 'postgres' : comm === 'redis-server' ? 'redis' : null
    if (which === null) continue
    const fields = stat.slice(close + 2).split(' ') // fields[0] is stat's 3rd field (state)
    ticks[which] += Number(fields[11]) + Number(fields[12]) // utime and stime, stat's 14th and 15th
  }
  return { server: ticks.server * TICK_MS, postgres: ticks.postgres * TICK_MS, redis: ticks.redis * TICK_MS }
}

/**
 * One process's CPU time so far, ms, user and system apart (null off Linux): where a request's cost
 * lies, in the process's own code or in the kernel on its behalf (socket reads and writes). The two
 * load generators cost bare's server the same user time per request and different system time
 * (docs/benchmarks.md "Side by side").
 */
export function processCpuMs (pid: number): { user: number, system: number } | null {
  if (process.platform !== 'linux') return null
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8')
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ')
  return { user: Number(fields[11]) * TICK_MS, system: Number(fields[12]) * TICK_MS }
}

/** CPU time so far, ms, of the process `serverPid` and of every PostgreSQL and Redis process, together. */
export function measuredCpuMs (serverPid: number): number | null {
  const split = measuredCpuSplitMs(serverPid)
  return split === null ? null : split.server + split.postgres + split.redis
}

/** µs of the measured side's CPU per request between two samples; null when either is missing. */
export function cpuUsPerRequest (beforeMs: number | null, afterMs: number | null, requests: number): number | null {
  if (beforeMs === null || afterMs === null || requests <= 0) return null
  return Math.round((afterMs - beforeMs) * 1000 / requests * 10) / 10
}

/**
 * Setup a's requests per CPU-second of the measured side over setup b's (b's CPU per request over
 * a's), to 3 decimals, in the orientation of a req/s ratio; null when either was not measured.
 */
export function perCpuRatio (aUsPerRequest: number | null, bUsPerRequest: number | null): number | null {
  if (aUsPerRequest === null || bUsPerRequest === null || aUsPerRequest <= 0) return null
  return Math.round(bUsPerRequest / aUsPerRequest * 1000) / 1000
}
