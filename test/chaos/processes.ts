import { spawn, type ChildProcess } from 'node:child_process'
import { createWriteStream, type WriteStream } from 'node:fs'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

/**
 * Child processes of the harness (app instances, the provider): started with tsx and an IPC
 * channel, which is also their lifeline (each exits when the channel closes, so a harness that dies
 * takes them with it). Every child still running is SIGKILLed by killAll(), which the runner calls
 * on exit, on SIGINT/SIGTERM and on errors.
 */

export const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..')
const live = new Set<ChildProcess>()

export interface Started {
  readonly child: ChildProcess
  /** The first IPC message the child sent (its `ready`). */
  readonly ready: Record<string, unknown>
  /** The last KBs the child wrote to stderr: why it died, when it did. */
  readonly stderrTail: () => string
}

/** Enough to still hold the fatal error's first line after the pages of properties Node may print below it. */
const STDERR_TAIL_BYTES = 32_768

/**
 * Starts `node --import tsx [preloads] script` and waits (bounded) for its `{ type: 'ready' }`.
 * Its stdout and stderr are appended to `logFile`.
 */
export function startChild (script: string, env: Record<string, string>, logFile: string, preloads: readonly string[] = [], timeoutMs = 30_000): Promise<Started> {
  // A preload is named by its path relative to the root (cwd), as --import wants a path, not a bare name.
  const imports = ['--import', 'tsx', ...preloads.flatMap((preload) => ['--import', `./${preload}`])]
  const child = spawn(process.execPath, [...imports, path.join(ROOT, script)], {
    cwd: ROOT,
    env: { ...process.env, ...env },
    stdio: ['ignore', 'pipe', 'pipe', 'ipc']
  })
  live.add(child)
  child.once('exit', () => live.delete(child))
  const log: WriteStream = createWriteStream(logFile, { flags: 'a' })
  child.stdout?.pipe(log, { end: false })
  child.stderr?.pipe(log, { end: false })
  child.once('close', () => log.end())
  let tail = ''
  child.stderr?.on('data', (chunk: Buffer) => { tail = (tail + chunk.toString('utf8')).slice(-STDERR_TAIL_BYTES) })
  return new Promise<Started>((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL')
      reject(new Error(`chaos: ${script} did not get ready within ${timeoutMs} ms (see ${logFile})`))
    }, timeoutMs)
    child.on('message', function onMessage (message: unknown) {
      const m = message as Record<string, unknown> | null
      if (m === null || typeof m !== 'object' || m.type !== 'ready') return
      clearTimeout(timer)
      child.off('message', onMessage)
      resolve({ child, ready: m, stderrTail: () => tail })
    })
    child.once('exit', (code, signal) => {
      clearTimeout(timer)
      reject(new Error(`chaos: ${script} exited before it was ready (${signal ?? code}; see ${logFile})`))
    })
  })
}

/** SIGKILLs the child and resolves once it is gone. */
export function killChild (child: ChildProcess): Promise<void> {
  return new Promise((resolve) => {
    if (child.exitCode !== null || child.signalCode !== null) return resolve()
    child.once('exit', () => resolve())
    child.kill('SIGKILL')
  })
}

/**
 * Sends `message` over the child's IPC channel; false when the channel is already closed. A child can
 * die between that check and the write, which then fails asynchronously (EPIPE): without a callback
 * Node emits it as an 'error' on the child, which nothing handles and which ended a chaos run as a
 * harness failure. With one, a lost message is only lost; callers check its effect, not the send.
 */
export function sendTo (child: ChildProcess, message: object, lost: () => void = () => {}): boolean {
  if (!child.connected) return false
  try {
    child.send(message, (error) => { if (error !== null) lost() })
    return true
  } catch {
    return false
  }
}

/** Asks the child to shut down gracefully (it closes its server, letting requests in flight finish). */
export function shutdownChild (child: ChildProcess, timeoutMs = 8_000): Promise<void> {
  return new Promise((resolve) => {
    if (child.exitCode !== null || child.signalCode !== null) return resolve()
    const timer = setTimeout(() => { child.kill('SIGKILL') }, timeoutMs)
    child.once('exit', () => { clearTimeout(timer); resolve() })
    const kill = (): void => { child.kill('SIGKILL') }
    if (!sendTo(child, { type: 'shutdown' }, kill)) kill()
  })
}

/** Synchronous, for exit handlers. */
export function killAll (): void {
  for (const child of live) {
    try { child.kill('SIGKILL') } catch {}
  }
  live.clear()
}
