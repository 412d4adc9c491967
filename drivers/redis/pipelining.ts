import type { ChainableCommander, Cluster, Redis } from 'ioredis'
import type { Done, ScriptedCommands } from './scripts.js'

/**
 * Sends one pre-filter command: `command` issues it on the client or on the turn's pipeline, passing
 * `done` as its callback, and the promise settles with that command's own reply or error.
 */
export type Enqueue = <T>(command: (redis: ScriptedCommands, done: Done<T>) => unknown) => Promise<T>

/**
 * Commands sent together, once per event-loop turn, as one pipeline: one write to the socket instead
 * of one per command. A `--cpu-prof` of the benchmark server (docs/benchmarks.md) put most of a
 * Redis command's cost on the client in that write (the loopback delivers to Redis inside the
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
  if (client.isCluster || !enabled) {
    const send: Enqueue = async (command) => await new Promise((resolve, reject) => { command(direct, settle(resolve, reject)) })
    return send
  }

  /** The commands of the current turn, not sent yet, or null when none is queued. */
  let queued: Queued[] | null = null

  function flush (): void {
    const commands = queued!
    queued = null
    // A lone command goes straight to the client: a pipeline object per turn costs more than it saves
    // when nothing shares the write (one request per turn, at low concurrency).
    if (commands.length === 1) {
      issue(commands[0]!, direct)
      return
    }
    const pipeline = client.pipeline()
    for (const command of commands) issue(command, pipeline as unknown as ScriptedCommands)
    pipeline.exec().catch((error: Error) => {
      // The pipeline failed as a whole (ioredis then settles no command of it): each caller fails,
      // and falls through to the store. A command already answered ignores this.
      for (const command of commands) command.reject(error)
    })
  }

  const send: Enqueue = async (command) => await new Promise((resolve, reject) => {
    if (queued === null) {
      queued = []
      setImmediate(flush)
    }
    queued.push({ send: (redis) => command(redis, settle(resolve, reject)), reject })
  })
  return send
}

interface Queued {
  send: (redis: ScriptedCommands) => unknown
  reject: (error: Error) => void
}

/** Issues one queued command; one that throws (ioredis refusing an argument) fails alone, in its caller. */
function issue (command: Queued, redis: ScriptedCommands): void {
  try {
    command.send(redis)
  } catch (error) {
    command.reject(error instanceof Error ? error : new Error(String(error)))
  }
}

function settle<T> (resolve: (value: T) => void, reject: (error: Error) => void): Done<T> {
  return (error, reply) => {
    if (error !== null && error !== undefined) reject(error)
    else resolve(reply as T)
  }
}
