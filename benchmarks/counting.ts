/**
 * What reaches PostgreSQL and Redis, counted from outside the plugin, at the client: statements and
 * round trips on the wire of every connection the benchmark server opens, and Redis commands.
 *
 * - PostgreSQL: postgres.js's `socket` option hands it sockets this file connects and watches. Every
 *   byte it writes is read as frontend protocol messages (type byte, int32 length): each Execute
 *   ('E': a prepared or unnamed statement, BEGIN and COMMIT included) and each simple Query ('Q',
 *   counted once per statement it holds) is a statement. A round trip is a write that follows a read
 *   on the same connection: statements written together (postgres.js coalesces the writes of one
 *   tick, and pipelines queries queued on a busy connection) share one. Exact per request when one
 *   request runs at a time (run.ts's sequential probe); under concurrent load two requests'
 *   statements pipelined on one connection count as one round trip, so that figure is a lower bound.
 * - Redis (ioredis): every call of the client's `sendCommand` is a command (a pipeline's and a
 *   script's too: EVALSHA, and EVAL after a NOSCRIPT); a round trip is a write to its stream after a
 *   read. The one connection carries every request's commands, so again exact only sequentially.
 *
 * The cost is a few comparisons per message written, paid by every counted setup alike (the floors
 * too): nothing is copied, and the bytes pass through unchanged.
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
 * Statements in a simple Query's text (NUL-terminated): the non-empty pieces between top-level
 * semicolons, outside quotes, dollar quotes and comments.
 */
export function statementsIn (text: Buffer): number {
  const s = text.toString('utf8').replace(/\0$/, '')
  let count = 0
  let content = false
  for (let i = 0; i < s.length; i++) {
    const c = s[i]!
    if (c === "'" || c === '"') {
      const end = s.indexOf(c, i + 1)
      i = end < 0 ? s.length : end
      content = true
    } else if (c === '-' && s[i + 1] === '-') {
      const end = s.indexOf('\n', i)
      i = end < 0 ? s.length : end
    } else if (c === '/' && s[i + 1] === '*') {
      const end = s.indexOf('*/', i + 2)
      i = end < 0 ? s.length : end + 1
    } else if (c === '$') {
      const tag = /^\$[A-Za-z_]*\$/.exec(s.slice(i))?.[0]
      if (tag !== undefined) {
        const end = s.indexOf(tag, i + tag.length)
        i = end < 0 ? s.length : end + tag.length - 1
      }
      content = true
    } else if (c === ';') {
      if (content) count++
      content = false
    } else if (!/\s/.test(c)) {
      content = true
    }
  }
  return count + (content ? 1 : 0)
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
