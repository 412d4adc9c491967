import { createServer, connect, type AddressInfo, type Socket } from 'node:net'

/**
 * A TCP proxy on loopback that injects network faults between a client and a server: the failures
 * an idempotency key exists for (a request that did its work but whose answer never arrived, a
 * connection reset mid-answer, a partition) and the ones a store must survive (latency, resets and
 * partitions between the app and its database).
 *
 * @example
 * const proxy = await startFaultProxy({ host: '127.0.0.1', port: app.server.address().port })
 * proxy.set({ dropReplyProbability: 1 })   // the server does the work, the client never hears
 * await fetch(`http://127.0.0.1:${proxy.port}/payments`, …)   // rejects: the socket was closed
 * proxy.set({ dropReplyProbability: 0 })
 * await proxy.close()
 */

export interface FaultSettings {
  /** Delay added to every chunk, both directions, in ms. Order is kept. */
  latencyMs: number
  /** Per chunk arriving from upstream: reset both sockets (RST) instead of forwarding it. */
  resetProbability: number
  /**
   * Per connection, drawn when the upstream's first reply bytes arrive: destroy the client side
   * without forwarding them. The server did the work; the client never hears.
   */
  dropReplyProbability: number
  /**
   * A partition: connections are accepted but nothing is forwarded, in either direction. Bytes are
   * held, not lost (TCP retransmits across a short partition), and delivered when it heals; a
   * connection accepted meanwhile reaches the upstream only then.
   */
  blackhole: boolean
}

export interface FaultProxy {
  readonly port: number
  /** Changes the faults; takes effect on open connections too. */
  set (faults: Partial<FaultSettings>): void
  /** Destroy every open connection now (RST to both sides). */
  resetConnections (): void
  readonly stats: { connections: number, resets: number, dropped: number }
  close (): Promise<void>
}

export interface FaultProxyOptions {
  /** Source of randomness in [0, 1), for reproducible runs. @defaultValue Math.random */
  random?: () => number
}

const DEFAULTS: FaultSettings = { latencyMs: 0, resetProbability: 0, dropReplyProbability: 0, blackhole: false }

type Item = { readonly at: number, readonly chunk: Buffer | null } // null: the source ended (half-close)

/**
 * One direction of one connection: a FIFO that delivers each chunk `latencyMs` after it arrived,
 * never overtaking an earlier one (even when the latency is lowered meanwhile), and holds
 * everything while the proxy is blackholed.
 */
class Lane {
  private readonly queue: Item[] = []
  private timer: NodeJS.Timeout | null = null
  private lastAt = 0

  constructor (
    private readonly source: Socket,
    private readonly sink: () => Socket | null,
    private readonly settings: () => FaultSettings
  ) {}

  push (chunk: Buffer | null): void {
    const at = Math.max(Date.now() + this.settings().latencyMs, this.lastAt)
    this.lastAt = at
    this.queue.push({ at, chunk })
    this.pump()
  }

  pump (): void {
    if (this.timer !== null) return
    const sink = this.sink()
    if (sink === null || this.settings().blackhole) return
    const now = Date.now()
    while (this.queue.length > 0) {
      const head = this.queue[0] as Item
      if (head.at > now) {
        this.timer = setTimeout(() => { this.timer = null; this.pump() }, head.at - now)
        return
      }
      this.queue.shift()
      if (sink.destroyed) continue
      if (head.chunk === null) {
        sink.end()
      } else if (!sink.write(head.chunk)) {
        // Backpressure: stop reading until the other side has taken what it was given.
        this.source.pause()
        sink.once('drain', () => this.source.resume())
      }
    }
  }

  stop (): void {
    if (this.timer !== null) clearTimeout(this.timer)
    this.timer = null
    this.queue.length = 0
  }
}

class Connection {
  upstream: Socket | null = null
  toClient: Lane | null = null
  replied = false
  closed = false
  readonly toUpstream: Lane

  constructor (readonly client: Socket, settings: () => FaultSettings) {
    this.toUpstream = new Lane(client, () => this.upstream, settings)
  }

  pump (): void {
    this.toUpstream.pump()
    this.toClient?.pump()
  }

  /** Both sides go away now; with `rst`, as a RST (ECONNRESET on the peers), as a crashed middlebox would. */
  destroy (rst: boolean): void {
    if (this.closed) return
    this.closed = true
    this.toUpstream.stop()
    this.toClient?.stop()
    for (const socket of [this.client, this.upstream]) {
      if (socket === null || socket.destroyed) continue
      // A RST only on a socket still open for writing: once its write side ended, libuv refuses the
      // reset (EINVAL) and the handle is never closed (the process then cannot exit); one still
      // connecting has nothing to reset.
      if (rst && !socket.writableEnded && !socket.connecting) {
        try {
          socket.resetAndDestroy()
          continue
        } catch {}
      }
      socket.destroy()
    }
  }
}

/**
 * Starts the proxy on 127.0.0.1 (a free port) in front of `target`.
 * Randomness comes from `options.random`, so a seeded run injects the same faults.
 */
export function startFaultProxy (
  target: { host: string, port: number },
  faults: Partial<FaultSettings> = {},
  options: FaultProxyOptions = {}
): Promise<FaultProxy> {
  const random = options.random ?? Math.random
  let settings: FaultSettings = { ...DEFAULTS, ...faults }
  const current = (): FaultSettings => settings
  const open = new Set<Connection>()
  const stats = { connections: 0, resets: 0, dropped: 0 }

  function connectUpstream (connection: Connection): void {
    if (connection.upstream !== null || connection.closed) return
    const upstream = connect({ host: target.host, port: target.port })
    upstream.setNoDelay(true)
    const toClient = new Lane(upstream, () => connection.client, current)
    connection.upstream = upstream
    connection.toClient = toClient
    upstream.on('data', (chunk: Buffer) => {
      if (connection.closed) return
      if (!connection.replied) {
        connection.replied = true
        if (settings.dropReplyProbability > 0 && random() < settings.dropReplyProbability) {
          stats.dropped++
          connection.destroy(false)
          return
        }
      }
      if (settings.resetProbability > 0 && random() < settings.resetProbability) {
        stats.resets++
        connection.destroy(true)
        return
      }
      toClient.push(chunk)
    })
    upstream.on('end', () => { if (!connection.closed) toClient.push(null) })
    upstream.on('error', () => connection.destroy(true))
    connection.toUpstream.pump()
  }

  const server = createServer({ allowHalfOpen: true, noDelay: true }, (client) => {
    stats.connections++
    const connection = new Connection(client, current)
    open.add(connection)
    client.on('data', (chunk: Buffer) => { if (!connection.closed) connection.toUpstream.push(chunk) })
    client.on('end', () => { if (!connection.closed) connection.toUpstream.push(null) })
    client.on('error', () => connection.destroy(true))
    client.on('close', () => {
      open.delete(connection)
      if (!connection.closed && connection.upstream !== null && !connection.upstream.destroyed) {
        // The client is gone; let what it sent reach the server, then close that side too.
        connection.toUpstream.push(null)
      }
    })
    if (!settings.blackhole) connectUpstream(connection)
  })

  return new Promise<FaultProxy>((resolve, reject) => {
    server.once('error', reject)
    server.listen(0, '127.0.0.1', () => {
      server.off('error', reject)
      const port = (server.address() as AddressInfo).port
      resolve({
        port,
        stats,
        set (faults: Partial<FaultSettings>): void {
          settings = { ...settings, ...faults }
          if (!settings.blackhole) {
            // The partition healed: connect what was waiting, deliver what was held.
            for (const connection of open) {
              connectUpstream(connection)
              connection.pump()
            }
          }
        },
        resetConnections (): void {
          for (const connection of open) {
            if (!connection.closed) stats.resets++
            connection.destroy(true)
          }
          open.clear()
        },
        close (): Promise<void> {
          for (const connection of open) connection.destroy(true)
          open.clear()
          return new Promise<void>((resolve) => server.close(() => resolve()))
        }
      })
    })
  })
}
