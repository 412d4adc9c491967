import type { Cluster, Redis } from 'ioredis'
import type { Done, ScriptedCommands } from './scripts.js'

/**
 * Sends one pre-filter command: `command` issues it on the client or on the turn's pipeline, passing
 * `done` as its callback, so `done` receives that command's own reply or error (exactly once but
 * for a pipeline that fails as a whole, whose commands may hear of it a second time: callers
 * settle once and ignore the rest).
 */
export type Enqueue = <T>(command: (redis: ScriptedCommands, done: Done<T>) => unknown, done: Done<T>) => void

/**
 * Commands sent together, once per event-loop turn, as one pipeline: one write to the socket instead
 * of one per command. Most of a Redis command's cost on a loopback connection is on the client, in
 * that write (the loopback delivers to Redis inside the
 * writer's system call), and Redis spends less per command when it reads several per wake-up; the
 * requests of one turn share both.
 *
 * The flush runs in setImmediate, after the turn's I/O callbacks (every request whose bytes arrived
 * in that poll), so a command waits for no timer and no other round trip; a turn with one command
 * sends it on the client itself. A pipeline is not a transaction: each command is still its own
 * atomic script on its own key. Each reply reaches its
 * caller through the callback given with its own command, never by its position in the pipeline's
 * results, so no failure of another command can hand one key's record to another key's request.
 *
 * A Cluster client gets no pipeline: one pipeline must stay on one node, and the records' keys are
 * spread over all slots. Its commands go straight to the client (which can pipeline per node itself,
 * with its `enableAutoPipelining` option). So do a standalone client's when `enabled` is false (the
 * `pipeline` option).
 */
export function pipelining (client: Redis | Cluster, enabled: boolean): Enqueue {
  const direct = client as unknown as ScriptedCommands
  if (client.isCluster || !enabled) return (command, done) => { issue(command, done, direct) }

  /** The commands of the current turn, not sent yet, or null when none is queued. */
  let queued: Array<Queued<unknown>> | null = null

  function flush (): void {
    const commands = queued!
    queued = null
    // A lone command goes straight to the client: a pipeline object per turn costs more than it saves
    // when nothing shares the write (one request per turn, at low concurrency).
    if (commands.length === 1) {
      const lone = commands[0]!
      issue(lone.command, lone.done, direct)
      return
    }
    const pipeline = client.pipeline()
    for (const queuedCommand of commands) issue(queuedCommand.command, queuedCommand.done, pipeline as unknown as ScriptedCommands)
    pipeline.exec().catch((error: Error) => {
      // The pipeline failed as a whole (ioredis then settles no command of it): each caller fails,
      // and falls through to the store. A command already answered ignores this.
      for (const queuedCommand of commands) queuedCommand.done(error)
    })
  }

  return (command, done) => {
    if (queued === null) {
      queued = []
      setImmediate(flush)
    }
    queued.push({ command, done } as Queued<unknown>)
  }
}

interface Queued<T> {
  command: (redis: ScriptedCommands, done: Done<T>) => unknown
  done: Done<T>
}

/** Issues one command; one that throws (ioredis refusing an argument) fails alone, in its caller. */
function issue<T> (command: Queued<T>['command'], done: Done<T>, redis: ScriptedCommands): void {
  try {
    command(redis, done)
  } catch (error) {
    done(error instanceof Error ? error : new Error(String(error)))
  }
}
