/**
 * A full `npm run bench` pins, through `taskset`: autocannon (it runs in run.ts's process) on CPU 0,
 * the servers, PostgreSQL and Redis on the other CPUs. Unpinned, the scheduler moves the generator
 * and the server between the CPUs and the same bare server's CPU per request changes from one
 * second to the next; pinned, the generator never takes CPU from what it measures, and every
 * setup shares the same CPUs with its backends. Linux with 2 or more CPUs only; PostgreSQL and
 * Redis get their own affinity back at the end (`restore`): they may be the user's servers.
 */
import { execFileSync, spawnSync } from 'node:child_process'
import os from 'node:os'

export interface Pinning {
  readonly pinned: boolean
  readonly description: string
  /** The command line that runs `command args` on the measured side's CPUs. */
  measured: (command: string, args: readonly string[]) => [string, string[]]
  restore: () => void
}

function unpinnable (): string | null {
  if (process.platform !== 'linux') return 'not Linux'
  if (os.availableParallelism() < 2) return 'one CPU'
  if (spawnSync('taskset', ['--version']).error !== undefined) return 'no taskset (util-linux)'
  return null
}

export function pinning (wanted: boolean): Pinning {
  const reason = wanted ? unpinnable() : 'not asked to'
  if (reason !== null) {
    return { pinned: false, description: `not pinned (${reason})`, measured: (command, args) => [command, [...args]], restore: () => {} }
  }
  const cpus = os.availableParallelism()
  const measured = cpus === 2 ? '1' : `1-${cpus - 1}`
  execFileSync('taskset', ['-a', '-p', '-c', '0', String(process.pid)], { stdio: 'ignore' })
  const moved = new Map<string, string>()
  for (const name of ['postgres', 'redis-server']) {
    for (const pid of spawnSync('pgrep', ['-x', name], { encoding: 'utf8' }).stdout.split('\n').filter(Boolean)) {
      // "pid 123's current affinity list: 0,1"
      const list = /:\s*(\S+)\s*$/.exec(spawnSync('taskset', ['-p', '-c', pid], { encoding: 'utf8' }).stdout)?.[1]
      if (list !== undefined) moved.set(pid, list)
      spawnSync('taskset', ['-a', '-p', '-c', measured, pid], { stdio: 'ignore' })
    }
  }
  return {
    pinned: true,
    description: `pinned: the load generator on CPU 0; the servers, PostgreSQL and Redis on CPU ${measured}`,
    measured: (command, args) => ['taskset', ['-c', measured, command, ...args]],
    restore () {
      for (const [pid, list] of moved) spawnSync('taskset', ['-a', '-p', '-c', list, pid], { stdio: 'ignore' })
      moved.clear()
    }
  }
}
