/**
 * A benchmark server (server.ts) in a process of its own, on the measured side's CPUs (pinning.ts):
 * resolved once it prints its `{"port":n}` line, stopped with SIGTERM (SIGKILL after 5 s).
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import type { Pinning } from './pinning.js'

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const SERVER = fileURLToPath(new URL('./server.ts', import.meta.url))

export interface BenchServer {
  readonly url: string
  /** Rejects unless the server exits with status 0 (it closes its stores first). */
  stop: () => Promise<void>
}

/** `env`: server.ts's configuration (SETUP, BENCH_PAYLOAD, …); `running` holds the child while it runs, for an exit handler. */
export async function startBenchServer (pin: Pinning, env: Record<string, string>, running: Set<ChildProcess>): Promise<BenchServer> {
  const [command, argv] = pin.measured(process.execPath, ['--import', 'tsx', SERVER])
  const child = spawn(command, argv, { cwd: ROOT, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'inherit'] })
  running.add(child)
  const label = env.SETUP ?? 'server'
  const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => { running.delete(child); resolve(code) }))
  const port = await new Promise<number>((resolve, reject) => {
    const timer = setTimeout(() => { child.kill('SIGKILL'); reject(new Error(`server ${label} did not listen within 30 s`)) }, 30_000)
    createInterface({ input: child.stdout! }).on('line', (line) => {
      let port: unknown
      try { port = (JSON.parse(line) as { port?: unknown }).port } catch { return }
      if (typeof port === 'number') { clearTimeout(timer); resolve(port) }
    })
    void exited.then((code) => { clearTimeout(timer); reject(new Error(`server ${label} exited (${code}) before listening`)) })
  })
  return {
    url: `http://127.0.0.1:${port}`,
    async stop () {
      child.kill('SIGTERM')
      const timer = setTimeout(() => child.kill('SIGKILL'), 5_000)
      const code = await exited
      clearTimeout(timer)
      if (code !== 0) throw new Error(`server ${label} exited with ${code} on SIGTERM`)
    }
  }
}
