/**
 * What reaches PostgreSQL and Redis, counted at the client, outside the plugin:
 * - PostgreSQL: postgres.js's `socket` option hands it sockets this file connects and watches.
 *   Every Execute message ('E', BEGIN and COMMIT included) and every statement of a simple Query
 *   ('Q') written is a statement; a write after a read on the same connection is a round trip, so
 *   statements pipelined together share one. Exact when one request runs at a time (run.ts's
 *   probe); under concurrent load, a lower bound for round trips.
 * - Redis (ioredis): each `sendCommand` call is a command (a pipeline's and a script's too); a write
 *   to its stream after a read is a round trip.
 * Every counted setup, the floors too, pays the same few comparisons per message written.
 */
import net from 'node:net'
import type { Redis } from 'ioredis'

export interface WireCounts {
  /** PostgreSQL: Execute and simple-Query statements; Redis: commands. */
  statements: number
  roundTrips: number
}

export const emptyCounts = (): WireCounts => ({ statements: 0, roundTrips: 0 })

/** The parsed connection options postgres.js passes to its `socket` option (arrays: multi-host). */
interface SocketOptions { host: string[], port: number[], path?: string | false }

const EXECUTE = 0x45 // 'E'
const QUERY = 0x51 // 'Q'

/**
 * For postgres.js's (undocumented in its types, present since 3.0) `socket` option: a connected
 * socket whose traffic is counted into `counts`. Connects as postgres.js itself does (a plain
 * net.Socket, same defaults), to the first host only.
 */
export function countingSocket (counts: WireCounts): (options: SocketOptions) => Promise<net.Socket> {
  return (options) => new Promise((resolve, reject) => {
    const socket = new net.Socket()
    socket.once('error', reject)
    socket.once('connect', () => {
      socket.off('error', reject)
      countPostgres(socket, counts)
      resolve(socket)
    })
    if (typeof options.path === 'string' && options.path !== '') socket.connect(options.path)
    else socket.connect(options.port[0] ?? 5432, options.host[0] ?? 'localhost')
  })
}

function countPostgres (socket: net.Socket, counts: WireCounts): void {
  let answered = true // a read since the last write: the next write starts a round trip
  let untyped = true // the startup message has no type byte
  const header = Buffer.alloc(5)
  let filled = 0
  let skip = 0 // bytes of the current message not seen yet
  let query: Buffer[] | null = null // the text of a simple Query, gathered across writes
  // Before postgres.js's own listener, which may write the next queued query from inside it.
  socket.prependListener('data', () => { answered = true })

  function scan (chunk: Uint8Array): void {
    let i = 0
    while (i < chunk.length) {
      if (skip > 0) {
        const n = Math.min(skip, chunk.length - i)
        if (query !== null) query.push(Buffer.from(chunk.subarray(i, i + n))) // a copy: postgres.js reuses its buffers
        skip -= n
        i += n
        if (skip === 0 && query !== null) { counts.statements += statementsIn(Buffer.concat(query)); query = null }
        continue
      }
      const size = untyped ? 4 : 5
      while (filled < size && i < chunk.length) header[filled++] = chunk[i++]!
      if (filled < size) return
      const length = header.readInt32BE(size - 4) // counts itself, not the type byte
      if (!untyped && header[0] === EXECUTE) counts.statements++
      if (!untyped && header[0] === QUERY) query = []
      untyped = false
      filled = 0
      skip = length - 4
      if (skip === 0 && query !== null) { counts.statements += 1; query = null }
    }
  }

  const write = socket.write
  socket.write = function (this: net.Socket, chunk: unknown, ...rest: unknown[]): boolean {
    if (chunk instanceof Uint8Array) scan(chunk)
    else if (typeof chunk === 'string') scan(Buffer.from(chunk))
    if (answered) { answered = false; counts.roundTrips++ }
    return (write as (...args: unknown[]) => boolean).call(this, chunk, ...rest)
  } as typeof socket.write
}

/**
 * Statements in a simple Query's text (NUL-terminated): the non-empty pieces between semicolons
 * outside quoted strings and identifiers (the driver's texts hold neither comments nor dollar quotes).
 */
export function statementsIn (text: Buffer): number {
  return text.toString('utf8').replace(/\0$/, '').replace(/'(?:[^']|'')*'|"(?:[^"]|"")*"/g, "''").split(';').filter((part) => part.trim() !== '').length
}

/**
 * Counts `client`'s commands (sendCommand) and round trips (writes to its stream after a read, on
 * every stream it connects: a reconnect brings a new one) into `counts`.
 */
export function countRedis (client: Redis, counts: WireCounts): void {
  const send = client.sendCommand
  client.sendCommand = function (this: Redis, ...args: Parameters<Redis['sendCommand']>) {
    counts.statements++
    return send.apply(this, args)
  } as Redis['sendCommand']
  const watched = new WeakSet<object>()
  const watch = (): void => {
    const stream = (client as unknown as { stream?: net.Socket }).stream
    if (stream === undefined || watched.has(stream)) return
    watched.add(stream)
    let answered = true
    stream.prependListener('data', () => { answered = true })
    const write = stream.write
    stream.write = function (this: net.Socket, ...args: unknown[]): boolean {
      if (answered) { answered = false; counts.roundTrips++ }
      return (write as (...args: unknown[]) => boolean).apply(this, args)
    } as typeof stream.write
  }
  client.on('connect', watch)
  watch()
}
