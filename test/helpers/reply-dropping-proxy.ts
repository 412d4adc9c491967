import { createServer, connect, type AddressInfo, type Server, type Socket } from 'node:net'

/**
 * TCP proxies on loopback, one per target, that lose the answer to one chosen command: the command
 * reaches the server and runs, and the connection it came on is cut as soon as the server answers,
 * before a byte of the answer reaches the client. That is the one fault a client cannot tell from a
 * command that never ran, and the one after which ioredis sends the same command again on its next
 * connection (its `autoResendUnfulfilledCommands`; a Cluster client retries it after
 * `retryDelayOnFailover`).
 *
 * The command is chosen by a byte string it contains (a Redis key, say), so the cut does not depend
 * on timing: a command that does not contain it passes, and so does everything once the cut is made.
 * The proxies share one arming, so a Cluster client whose nodes are all behind them (its `natMap`
 * option: `dropper.natMap`) loses the answer of whichever node the command went to.
 *
 * @example
 * const dropper = await startReplyDropper([{ host: '127.0.0.1', port: 6379 }])
 * const redis = new Redis({ host: '127.0.0.1', port: dropper.ports[0] })
 * const cut = dropper.dropReplyTo(key)   // armed
 * await redis.get(key)                   // answered by the re-sent GET
 * await cut                              // the first one's answer was lost
 */
export interface ReplyDropper {
  /** The proxy's port for each target, in the targets' order. */
  readonly ports: readonly number[]
  /** `host:port` of each target to the proxy in front of it, as a Cluster client's `natMap`. */
  readonly natMap: Readonly<Record<string, { host: string, port: number }>>
  /**
   * Arms the proxies: the next command whose bytes contain `needle` is forwarded, and its connection
   * is cut (both sides) when the server's next bytes arrive on it, which are not forwarded; so the
   * armed command must be the only one on its connection still waiting for an answer. Resolves once
   * the cut is made; arming again before that replaces the needle.
   */
  dropReplyTo (needle: string | Buffer): Promise<void>
  /** Answers lost so far. */
  readonly dropped: number
  /** Connections accepted so far, over all proxies. */
  readonly connections: number
  close (): Promise<void>
}

const EMPTY = Buffer.alloc(0)

interface Armed {
  readonly needle: Buffer
  readonly cut: () => void
}

export async function startReplyDropper (targets: ReadonlyArray<{ host: string, port: number }>): Promise<ReplyDropper> {
  let armed: Armed | null = null
  let dropped = 0
  let connections = 0
  const sockets = new Set<Socket>()
  const servers: Server[] = []

  function proxy (target: { host: string, port: number }): Server {
    return createServer({ noDelay: true }, (inbound) => {
      connections++
      const outbound = connect({ host: target.host, port: target.port })
      outbound.setNoDelay(true)
      sockets.add(inbound).add(outbound)
      /** Set once this connection forwarded the armed command: the server's next bytes are its answer. */
      let doomed: Armed | null = null
      /** The end of what came from the client, so a needle split across two reads still matches. */
      let tail = EMPTY

      inbound.on('data', (chunk: Buffer) => {
        if (armed !== null && doomed === null) {
          const needle = armed.needle
          const seen = tail.length === 0 ? chunk : Buffer.concat([tail, chunk])
          if (seen.includes(needle)) {
            doomed = armed
            armed = null
            tail = EMPTY
          } else {
            tail = Buffer.from(seen.subarray(Math.max(0, seen.length - needle.length + 1)))
          }
        }
        outbound.write(chunk)
      })
      outbound.on('data', (chunk: Buffer) => {
        if (doomed !== null) {
          // The command ran (the server answered it): the client never hears how.
          const cut = doomed
          doomed = null
          dropped++
          inbound.destroy()
          outbound.destroy()
          cut.cut()
          return
        }
        inbound.write(chunk)
      })
      inbound.on('error', () => {})
      outbound.on('error', () => {})
      inbound.on('close', () => { sockets.delete(inbound); outbound.destroy() })
      outbound.on('close', () => { sockets.delete(outbound); inbound.destroy() })
    })
  }

  const ports: number[] = []
  const natMap: Record<string, { host: string, port: number }> = {}
  for (const target of targets) {
    const server = proxy(target)
    servers.push(server)
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject)
      server.listen(0, '127.0.0.1', () => { server.off('error', reject); resolve() })
    })
    const port = (server.address() as AddressInfo).port
    ports.push(port)
    natMap[`${target.host}:${target.port}`] = { host: '127.0.0.1', port }
  }

  return {
    ports,
    natMap,
    dropReplyTo (needle) {
      return new Promise<void>((resolve) => {
        armed = { needle: Buffer.from(needle), cut: resolve }
      })
    },
    get dropped () { return dropped },
    get connections () { return connections },
    async close () {
      armed = null
      for (const socket of sockets) socket.destroy()
      await Promise.all(servers.map((server) => new Promise<void>((resolve) => server.close(() => resolve()))))
    }
  }
}
