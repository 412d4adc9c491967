import { spawn, type ChildProcess } from 'node:child_process'
import { createInterface } from 'node:readline'
import type { Test } from 'tap'

export interface ChildApp {
  readonly child: ChildProcess
  readonly port: number
  /** The next stdout message carrying `field` (bounded wait), removed from the queue. */
  next (field: string, limitMs?: number): Promise<unknown>
  /** SIGKILL, and wait until the process is gone. */
  kill (): Promise<void>
}

/**
 * Starts a fixture app (`node --import tsx <file>`) in a child process, killed when the test ends.
 * Fixtures speak one JSON object a line on stdout and announce `{"port":n}` once listening.
 */
export async function spawnFixture (t: Test, file: string, env: Record<string, string>): Promise<ChildApp> {
  const child = spawn(process.execPath, ['--import', 'tsx', file], { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'inherit'] })
  t.teardown(() => { child.kill('SIGKILL') })
  const messages: Array<Record<string, unknown>> = []
  const waiting: Array<() => void> = []
  createInterface({ input: child.stdout as NodeJS.ReadableStream }).on('line', (line) => {
    try { messages.push(JSON.parse(line) as Record<string, unknown>) } catch { return }
    for (const wake of waiting.splice(0)) wake()
  })
  const next = async (field: string, limitMs = 20_000): Promise<unknown> => {
    const deadline = Date.now() + limitMs
    for (;;) {
      const index = messages.findIndex((m) => field in m)
      if (index >= 0) return messages.splice(index, 1)[0]?.[field]
      if (Date.now() > deadline || child.exitCode !== null) throw new Error(`fixture ${file} did not report ${field}`)
      await new Promise<void>((resolve) => { waiting.push(resolve); setTimeout(resolve, 100) })
    }
  }
  const kill = async (): Promise<void> => {
    if (child.exitCode !== null || child.signalCode !== null) return
    const gone = new Promise<void>((resolve) => child.once('exit', () => resolve()))
    child.kill('SIGKILL')
    await gone
  }
  const port = await next('port') as number
  return { child, port, next, kill }
}
