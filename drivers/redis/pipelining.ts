import type { ChainableCommander, Cluster, Redis } from 'ioredis'
import type { ScriptedCommands } from './scripts.js'

/**
 * Where a pre-filter operation queues its one command: the client itself, or a pipeline that
 * collects the commands of every request handled in the same event-loop turn.
 */
export type Enqueue = <T>(command: (target: ScriptedCommands<unknown>) => unknown) => Promise<T>

/**
 * Commands sent together, once per event-loop turn, as one pipeline: one write to the socket instead
 * of one per command. A `--cpu-prof` of the benchmark server (docs/benchmarks.md) put most of a
 * Redis command's cost on the client in that write (the loopback delivers to Redis inside the
 * writer's system call) and most of Redis's in reading one command per wake-up; the requests of one
 * turn share both.
 *
 * The flush runs in setImmediate, after the turn's I/O callbacks (every request whose bytes arrived
 * in that poll), so a command waits for no timer and no other round trip. A pipeline is not a
 * transaction: each command is still its own atomic script on its own key, and each gets its own
 * reply or error.
 *
 * A Cluster client gets no pipeline: one pipeline must stay on one node, and the records' keys are
 * spread over all slots. Its commands go straight to the client (which can pipeline per node itself,
 * with its `enableAutoPipelining` option). So do a standalone client's when `enabled` is false (the
 * `pipeline` option).
 */
export function pipelining (client: Redis | Cluster, enabled: boolean): Enqueue {
  if (client.isCluster || !enabled) return async (command) => await (command(client as unknown as ScriptedCommands<unknown>) as Promise<never>)

  /** The current turn's commands, or null when none is queued. */
  let batch: { pipeline: ChainableCommander, settlers: Array<Settler<unknown>> } | null = null

  function flush (): void {
    const { pipeline, settlers } = batch!
    batch = null
    pipeline.exec().then((replies) => {
      for (let i = 0; i < settlers.length; i++) {
        const [error, value] = replies?.[i] ?? [new Error('fastify-idempotency: redis pipeline returned no reply for a command'), undefined]
        if (error === null) settlers[i]!.resolve(value)
        else settlers[i]!.reject(error)
      }
    }, (error: Error) => {
      // The pipeline failed as a whole (nothing was sent, or its state is unknown): every command of
      // it failed, and each caller falls through to the store.
      for (const settler of settlers) settler.reject(error)
    })
  }

  return async <T>(command: (target: ScriptedCommands<unknown>) => unknown): Promise<T> => {
    if (batch === null) {
      batch = { pipeline: client.pipeline(), settlers: [] }
      setImmediate(flush)
    }
    const { pipeline, settlers } = batch
    return await new Promise<T>((resolve, reject) => {
      command(pipeline as unknown as ScriptedCommands<unknown>)
      settlers.push({ resolve: resolve as (value: unknown) => void, reject })
    })
  }
}

interface Settler<T> {
  resolve: (value: T) => void
  reject: (error: Error) => void
}
