/**
 * Pinning (run.ts and crosscheck.ts; the default of a full run, `--unpinned` to turn it off, `--pin`
 * to pin a quick run too): the load generator on CPU 0, everything it measures (the server
 * process, PostgreSQL, Redis) on the other CPUs, through `taskset`.
 *
 * Why (issue 14): unpinned, the generator shares the two cores with what it measures, so a ratio
 * between a setup bounded by CPU (bare) and one bounded by a backend's latency (pg-lease under the
 * storm) depends on how much CPU the generator takes per request, and autocannon (JavaScript) and
 * wrk (C) take different amounts: six of the sixteen ratios differed by more than 15% between the
 * two harnesses. Unpinned, the scheduler also moves the server and the generator between the CPUs,
 * and the same bare server took 37 µs of CPU per request in one second and 67 in the next. Pinned,
 * the measured side has the same CPUs whichever generator drives it, and as long as the generator
 * keeps up (its CPU is reported, `generatorCpuShare`), both harnesses measure the same thing: what
 * a request costs the measured side's CPUs.
 *
 * Linux only (taskset, from util-linux); a machine with one CPU cannot be pinned this way (a full
 * run there goes unpinned, and says so). The PostgreSQL and Redis processes moved to the measured
 * side get their own CPUs back at the end (`restore`): they may be the user's servers.
 */
import { execFileSync, spawnSync } from 'node:child_process'
import os from 'node:os'

export interface Pinning {
  readonly pinned: boolean
  /** The command line that runs `command args` on the measured side's CPUs (unchanged when not pinning). */
  measured (command: string, args: readonly string[]): [string, string[]]
  /** The command line that runs `command args` on the generator's CPU. */
  generator (command: string, args: readonly string[]): [string, string[]]
  /** Moves running PostgreSQL and Redis servers (and, as they fork, their backends) to the measured side. */
  moveServices (): void
  /** Gives the processes moveServices moved their CPUs back. */
  restore (): void
  /** What the results say about the pinning. */
  readonly description: string
}

const GENERATOR_CPU = '0'

/** Why this machine cannot be pinned, or null when it can. */
function unpinnable (): string | null {
  if (process.platform !== 'linux') return 'not Linux'
  const cpus = os.availableParallelism()
  if (cpus < 2) return `${cpus} CPU`
  if (spawnSync('taskset', ['--version']).error !== undefined) return 'no taskset (util-linux: apt-get install -y util-linux)'
  return null
}

/**
 * `mode`: 'pin' pins or throws why it cannot; 'auto' pins where the machine can, and otherwise
 * says why not in `description`; 'off' does not pin.
 */
export function pinning (mode: 'pin' | 'auto' | 'off'): Pinning {
  const reason = mode === 'off' ? 'not asked to' : unpinnable()
  if (reason !== null) {
    if (mode === 'pin') throw new Error(`--pin: this machine cannot be pinned (${reason})`)
    return {
      pinned: false,
      measured: (command, args) => [command, [...args]],
      generator: (command, args) => [command, [...args]],
      moveServices: () => {},
      restore: () => {},
      description: `not pinned (${reason}): the generator, the servers, PostgreSQL and Redis share every CPU`
    }
  }
  const cpus = os.availableParallelism()
  const measuredCpus = cpus === 2 ? '1' : `1-${cpus - 1}`
  // This process: the generator for run.ts (autocannon runs in it), the driver for crosscheck.ts.
  execFileSync('taskset', ['-a', '-p', '-c', GENERATOR_CPU, String(process.pid)], { stdio: 'ignore' })
  const moved = new Map<string, string>()
  return {
    pinned: true,
    measured: (command, args) => ['taskset', ['-c', measuredCpus, command, ...args]],
    generator: (command, args) => ['taskset', ['-c', GENERATOR_CPU, command, ...args]],
    moveServices () {
      for (const name of ['postgres', 'redis-server']) {
        const found = spawnSync('pgrep', ['-x', name], { encoding: 'utf8' }).stdout.split('\n').filter((pid) => pid !== '')
        for (const pid of found) {
          // `taskset -p -c <pid>`: "pid 123's current affinity list: 0,1"
          const list = /:\s*(\S+)\s*$/.exec(spawnSync('taskset', ['-p', '-c', pid], { encoding: 'utf8' }).stdout)?.[1]
          if (list !== undefined && !moved.has(pid)) moved.set(pid, list)
          spawnSync('taskset', ['-a', '-p', '-c', measuredCpus, pid], { stdio: 'ignore' })
        }
      }
    },
    restore () {
      for (const [pid, list] of moved) spawnSync('taskset', ['-a', '-p', '-c', list, pid], { stdio: 'ignore' })
      moved.clear()
    },
    description: `pinned: the load generator on CPU ${GENERATOR_CPU}; the server, PostgreSQL and Redis on CPU ${measuredCpus}`
  }
}

/** CPU time (user + system) this process used since `since`, in ms: how busy the in-process generator was. */
export function cpuMsSince (since: NodeJS.CpuUsage): number {
  const used = process.cpuUsage(since)
  return (used.user + used.system) / 1000
}
