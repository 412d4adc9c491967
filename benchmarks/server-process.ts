/**
 * A benchmark server (benchmarks/server.ts) in a process of its own, for every script that measures
 * one (run.ts, crosscheck.ts, page-faults.ts): started on the measured side's CPUs, resolved once it
 * prints its `{"port":n}` line, stopped with SIGTERM (SIGKILL after 5 s).
 */
import { spawn, type ChildProcess } from 'node:child_process'
import path from 'node:path'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import type { Pinning } from './pinning.js'

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const SERVER = path.join(ROOT, 'benchmarks', 'server.ts')
const LISTEN_TIMEOUT_MS = 30_000
const STOP_GRACE_MS = 5_000

export interface BenchServer {
  readonly url: string
  /** The server's own pid: taskset execs it, so a pinned child's pid is the server's (its /proc is the server's). */
  readonly pid: number
  /** Stops the server; rejects unless it exits with status 0 (server.ts closes its stores first). */
  stop: () => Promise<void>
}

export interface BenchServerOptions {
  /** Where the server runs (PIN.measured). */
  readonly pin: Pinning
  /** server.ts's configuration (SETUP, BENCH_PAYLOAD, DATABASE_URL, …), over this process's environment. */
  readonly env: Readonly<Record<string, string>>
  /** Names the server in errors. */
  readonly label: string
  /** Holds the child while it runs, so that an exit handler can kill what is left (benchServices' onExit). */
  readonly running?: Set<ChildProcess>
}

export async function startBenchServer ({ pin, env, label, running }: BenchServerOptions): Promise<BenchServer> {
  const [command, argv] = pin.measured(process.execPath, ['--import', 'tsx', SERVER])
  const child = spawn(command, argv, { cwd: ROOT, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'inherit'] })
  running?.add(child)
  const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => { running?.delete(child); resolve(code) }))
  const port = await new Promise<number>((resolve, reject) => {
    const timer = setTimeout(() => { child.kill('SIGKILL'); reject(new Error(`server ${label} did not listen within ${LISTEN_TIMEOUT_MS / 1000} s`)) }, LISTEN_TIMEOUT_MS)
    createInterface({ input: child.stdout! }).on('line', (line) => {
      let port: unknown
      try { port = (JSON.parse(line) as { port?: unknown }).port } catch { return } // not the port line
      if (typeof port === 'number') { clearTimeout(timer); resolve(port) }
    })
    void exited.then((code) => { clearTimeout(timer); reject(new Error(`server ${label} exited (${code}) before listening`)) })
  })
  return {
    url: `http://127.0.0.1:${port}`,
    pid: child.pid!,
    async stop () {
      child.kill('SIGTERM')
      const timer = setTimeout(() => child.kill('SIGKILL'), STOP_GRACE_MS)
      const code = await exited
      clearTimeout(timer)
      if (code !== 0) throw new Error(`server ${label} exited with ${code} on SIGTERM`)
    }
  }
}
