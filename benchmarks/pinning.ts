/**
 * `--pin` (run.ts and crosscheck.ts): the load generator on CPU 0, everything it measures (the
 * server process, PostgreSQL, Redis) on the other CPUs, through `taskset`.
 *
 * Why (issue 14): unpinned, the generator shares the two cores with what it measures, so a ratio
 * between a setup bounded by CPU (bare) and one bounded by a backend's latency (pg-lease under the
 * storm) depends on how much CPU the generator takes per request, and autocannon (JavaScript) and
 * wrk (C) take different amounts: six of the sixteen ratios differed by more than 15% between the
 * two harnesses. Pinned, the measured side has the same CPUs whichever generator drives it, and as
 * long as the generator keeps up (its CPU is reported, `generatorCpu`), both harnesses measure the
 * same thing.
 *
 * Linux only (taskset, from util-linux); a machine with one CPU cannot be pinned this way.
 */
import { execFileSync, spawnSync } from 'node:child_process'
import os from 'node:os'

export interface Pinning {
  /** The command line that runs `command args` on the measured side's CPUs (unchanged when not pinning). */
  measured (command: string, args: readonly string[]): [string, string[]]
  /** The command line that runs `command args` on the generator's CPU. */
  generator (command: string, args: readonly string[]): [string, string[]]
  /** Moves running PostgreSQL and Redis servers (and, as they fork, their backends) to the measured side. */
  moveServices (): void
  /** What the results say about the pinning. */
  readonly description: string
}

const GENERATOR_CPU = '0'

export function pinning (enabled: boolean): Pinning {
  if (!enabled) {
    return {
      measured: (command, args) => [command, [...args]],
      generator: (command, args) => [command, [...args]],
      moveServices: () => {},
      description: 'not pinned: the generator, the servers, PostgreSQL and Redis share every CPU'
    }
  }
  const cpus = os.availableParallelism()
  if (cpus < 2) throw new Error(`--pin needs at least 2 CPUs; this machine has ${cpus}`)
  if (spawnSync('taskset', ['--version']).error !== undefined) throw new Error('--pin needs taskset (util-linux): apt-get install -y util-linux')
  const measuredCpus = cpus === 2 ? '1' : `1-${cpus - 1}`
  // This process: the generator for run.ts (autocannon runs in it), the driver for crosscheck.ts.
  execFileSync('taskset', ['-a', '-p', '-c', GENERATOR_CPU, String(process.pid)], { stdio: 'ignore' })
  return {
    measured: (command, args) => ['taskset', ['-c', measuredCpus, command, ...args]],
    generator: (command, args) => ['taskset', ['-c', GENERATOR_CPU, command, ...args]],
    moveServices () {
      for (const name of ['postgres', 'redis-server']) {
        const found = spawnSync('pgrep', ['-x', name], { encoding: 'utf8' }).stdout.split('\n').filter((pid) => pid !== '')
        for (const pid of found) spawnSync('taskset', ['-a', '-p', '-c', measuredCpus, pid], { stdio: 'ignore' })
      }
    },
    description: `pinned: the load generator on CPU ${GENERATOR_CPU}; the server, PostgreSQL and Redis on CPU ${measuredCpus}`
  }
}

/** CPU time (user + system) this process used since `since`, in ms: how busy the in-process generator was. */
export function cpuMsSince (since: NodeJS.CpuUsage): number {
  const used = process.cpuUsage(since)
  return (used.user + used.system) / 1000
}
