import { randomUUID } from 'node:crypto'
import type { Cluster, Redis } from 'ioredis'
import type { IdempotencyPrefilter, PrefilterHit } from '../../lib/core/prefilter.js'
import type { Fingerprint, RecordId, SettlementHandlers, StoredResponse } from '../../lib/core/store.js'
import { settlementDigest } from '../../lib/core/waiters.js'
import { PrefilterClosedError, PrefilterTimeoutError } from './errors.js'
import { FIELD, recordKey } from './keys.js'
import { resolvePrefilterOptions, type RedisPrefilterOptions } from './options.js'
import { pipelining } from './pipelining.js'
import { COMMAND, defineScripts, type Done, type ScriptedCommands } from './scripts.js'
import { Schedule, type Scheduled } from '../../lib/core/schedule.js'

/**
 * The Redis pre-filter: answers duplicates from Redis during retry storms and never decides who
 * executes. Every method is one command or one Lua script on one hash, bounded by `timeout`;
 * anything that goes wrong rejects, and the core reads a rejection as a miss.
 *
 * A RecordId object stands for one request: the core passes the same object to every call it makes
 * for a request, and the in-flight markers a request writes carry a token drawn for that object
 * (scripts.ts says why). A request's own marker never reads as another request in flight: its
 * lookupOrMark reports it as marked, its lookup as a miss. A caller that marks and clears through
 * two objects is two requests: the second does not clear the first's marker.
 */
/** Counters of what the pre-filter did: how often it answered, and how often it fell through to the store. */
export interface PrefilterStats {
  /** Lookups answered from Redis (a completed record or an in-flight marker). */
  readonly hits: number
  /** Lookups that found nothing: the store answered. */
  readonly misses: number
  /** Operations that failed or exceeded `timeout`: the request fell through to the store (fail open). */
  readonly failures: number
}

export interface RedisPrefilter extends IdempotencyPrefilter {
  readonly stats: PrefilterStats
}

export function redisPrefilter (options: RedisPrefilterOptions): RedisPrefilter {
  const { client, prefix, timeout, pipeline } = resolvePrefilterOptions(options)
  /** Where settlements of marked keys are published (scripts.ts, CLEAR and REMEMBER): settlementDigest(scope, key). */
  const channel = `${prefix}:settled`
  defineScripts(client)
  const enqueue = pipelining(client, pipeline)
  const stats = { hits: 0, misses: 0, failures: 0 }
  /**
   * The deadlines of operations still waiting, one shared schedule (lib/core/schedule.ts) instead of a
   * timer per operation; close() settles whatever is left in it. Unref'd: a deadline must not keep
   * a process alive on its own.
   */
  const deadlines = new Schedule<Waiting>(timeout, (waiting) => {
    stats.failures++
    waiting.fail(new PrefilterTimeoutError(waiting.operation, timeout))
  }, false)
  let closed = false

  /**
   * Sends one command with a deadline. The promise settles once: with the command's reply or
   * error, with the deadline's error, or with close()'s, whichever comes first. An item still in
   * the schedule is an operation not settled yet; a reply that comes after its deadline finds it
   * gone, and is dropped (never an unhandled rejection).
   */
  function bounded<T> (operation: string, command: (redis: ScriptedCommands, done: Done<T>) => unknown): Promise<T> {
    if (closed) return Promise.reject(new PrefilterClosedError(operation))
    return new Promise<T>((resolve, reject) => {
      const waiting: Waiting = { dueAt: 0, previous: null, next: null, scheduled: false, operation, fail: reject }
      deadlines.add(waiting)
      // A command ioredis refuses as it is issued (a bad argument) comes back through `done` too
      // (pipelining.ts, issue): the same outcome as a failed reply.
      enqueue<T>(command, (error, reply) => {
        if (!waiting.scheduled) return // settled already, by the deadline or by close()
        deadlines.remove(waiting)
        if (error === null || error === undefined) {
          resolve(reply as T)
        } else {
          stats.failures++
          reject(error)
        }
      })
    })
  }

  /**
   * What is kept of each request, by its RecordId (one object for all of a request's calls): the
   * hash of its (scope, key), and its owner token once it marks. The token lives as long as the
   * object, so a command ioredis sends again carries the one its first delivery carried.
   */
  const callers = new WeakMap<RecordId, Caller>()
  const callerOf = (id: RecordId): Caller => {
    let caller = callers.get(id)
    if (caller === undefined) {
      caller = { key: recordKey(prefix, id), owner: null }
      callers.set(id, caller)
    }
    return caller
  }
  /** The request's token, drawn by its first marking call: 122 random bits, unique among requests. */
  const ownerOf = (caller: Caller): string => (caller.owner ??= randomUUID())

  const counted = (hit: PrefilterHit | null): PrefilterHit | null => {
    if (hit === null) stats.misses++
    else stats.hits++
    return hit
  }

  async function lookup (id: RecordId): Promise<PrefilterHit | null> {
    const caller = callerOf(id)
    // One HGETALL is atomic: a half-written record can never be seen (scripts write in one go).
    // The Buffer variant keeps digests and bodies byte-identical.
    const fields = await bounded<Record<string, Buffer>>('lookup', (redis, done) => redis.hgetallBuffer(caller.key, done))
    // The caller's own marker tells it nothing about another request: a miss, as lookupOrMark
    // reports it (a request must never wait on itself).
    if (caller.owner !== null && fields[FIELD.state]?.toString() === 'in_progress' &&
        fields[FIELD.owner]?.toString() === caller.owner) return counted(null)
    return counted(parseHit(fields))
  }

  return {
    lookup,

    async lookupOrMark (id, fingerprint, ttlMs) {
      const ttl = ttlOf('lookupOrMark', ttlMs)
      // A lease too short to hold a marker: a plain lookup (holding no marker is the safe side).
      if (ttl === 0) return { hit: await lookup(id), marked: false }
      const caller = callerOf(id)
      const owner = ownerOf(caller)
      const pairs = await bounded<Buffer[]>('lookupOrMark', (redis, done) =>
        redis[COMMAND.lookupOrMarkBuffer](caller.key, fingerprint.algorithm, fingerprint.digest, ttl, owner, done))
      // Empty: the marker is the caller's, written now or by a first delivery whose answer was lost.
      if (pairs.length === 0) {
        stats.misses++
        return { hit: null, marked: true }
      }
      return { hit: counted(parseHit(fieldsOf(pairs))), marked: false }
    },

    get stats (): PrefilterStats { return { ...stats } },

    async markInFlight (id, fingerprint, ttlMs) {
      const ttl = ttlOf('markInFlight', ttlMs)
      if (ttl === 0) return // nothing would outlive the lease: holding no marker is the safe side
      const caller = callerOf(id)
      const owner = ownerOf(caller)
      await bounded('markInFlight', (redis, done) =>
        redis[COMMAND.mark](caller.key, fingerprint.algorithm, fingerprint.digest, ttl, owner, done))
    },

    async clearInFlight (id) {
      if (closed) throw new PrefilterClosedError('clearInFlight')
      const caller = callerOf(id)
      // No token: the request never wrote a marker, so none is its to clear (and a round trip saved).
      const owner = caller.owner
      if (owner === null) return
      await bounded('clearInFlight', (redis, done) => redis[COMMAND.clear](caller.key, owner, channel, settlementDigest(id.scope, id.key), done))
    },

    async remember (id, fingerprint, response, ttlMs) {
      const ttl = ttlOf('remember', ttlMs)
      if (ttl === 0) return // the store's record is about to expire: a copy must not outlive it
      const retained = response.body !== null
      await bounded('remember', (redis, done) => redis[COMMAND.remember](
        callerOf(id).key, fingerprint.algorithm, fingerprint.digest, response.statusCode,
        JSON.stringify(response.headers), retained ? '1' : '0', response.body ?? EMPTY, ttl, channel, settlementDigest(id.scope, id.key), done))
    },

    watchSettlements: (handlers) => watchSettlements(client, channel, handlers),

    async close () {
      // The client is the user's: only our own deadlines stop, and waiting calls reject.
      closed = true
      deadlines.drain((waiting) => {
        stats.failures++
        waiting.fail(new PrefilterClosedError('close'))
      })
    }
  }
}

const EMPTY = Buffer.alloc(0)

/**
 * The settlements published on `channel`, through a connection of its own (a subscribed connection
 * runs no other command): `client.duplicate()`, with the client's settings. ioredis reconnects it
 * and subscribes again by itself; notices flow from each 'ready' to the next 'close'.
 */
function watchSettlements (client: Redis | Cluster, channel: string, handlers: SettlementHandlers): () => void {
  // Redis and Cluster both duplicate with no argument; their signatures do not unify in the types.
  const subscriber = (client as Redis).duplicate()
  let stopped = false
  const live = (flowing: boolean) => () => { if (!stopped) handlers.live(flowing) }
  // Reported by 'close', which follows; without a listener an 'error' event would end the process.
  subscriber.on('error', () => {})
  subscriber.on('message', (from: string, digest: string) => { if (from === channel && !stopped) handlers.settled(digest) })
  subscriber.on('ready', live(true))
  subscriber.on('close', live(false))
  subscriber.subscribe(channel).catch(() => {})
  return () => {
    stopped = true
    subscriber.disconnect()
  }
}

/** What the pre-filter keeps of one request (one RecordId object). */
interface Caller {
  /** The Redis key of its (scope, key): keys.ts. */
  readonly key: string
  /** The token its markers carry; null until it marks. */
  owner: string | null
}

/** An operation waiting for its reply, in the deadline schedule. */
interface Waiting extends Scheduled {
  readonly operation: string
  /** Rejects the operation's promise. */
  readonly fail: (error: Error) => void
}

/**
 * Whole milliseconds, rounded down so a copy never outlives what it mirrors; 0 means "do not
 * write". A non-number is a caller bug and rejects.
 */
function ttlOf (operation: string, ttlMs: number): number {
  if (typeof ttlMs !== 'number' || Number.isNaN(ttlMs)) {
    throw new TypeError(`fastify-idempotency: redis pre-filter ${operation}() needs a ttl in ms; received ${String(ttlMs)}`)
  }
  return Math.max(0, Math.floor(Math.min(ttlMs, Number.MAX_SAFE_INTEGER)))
}

/** A hash's reply (field, value, field, value, …) as an object. */
function fieldsOf (pairs: Buffer[]): Record<string, Buffer> {
  const fields: Record<string, Buffer> = {}
  for (let i = 0; i + 1 < pairs.length; i += 2) fields[pairs[i]!.toString()] = pairs[i + 1]!
  return fields
}

/**
 * Turns the hash back into a hit. Anything unexpected (a hash someone else wrote under our prefix,
 * a record from an incompatible version) reads as a miss: the store then answers, which is always
 * correct, whereas replaying a half-understood record would not be.
 */
function parseHit (fields: Record<string, Buffer>): PrefilterHit | null {
  const state = fields[FIELD.state]?.toString()
  const algorithm = fields[FIELD.algorithm]?.toString()
  const digest = fields[FIELD.digest]
  if (algorithm === undefined || digest === undefined) return null
  const fingerprint: Fingerprint = { algorithm, digest }
  if (state === 'in_progress') return { state, fingerprint }
  if (state !== 'completed') return null

  const statusCode = Number(fields[FIELD.status]?.toString())
  if (!Number.isInteger(statusCode) || statusCode < 100 || statusCode > 999) return null
  const headers = parseHeaders(fields[FIELD.headers])
  if (headers === null) return null
  const response: StoredResponse = { statusCode, headers, body: fields[FIELD.body] ?? null }
  return { state, fingerprint, response }
}

function parseHeaders (raw: Buffer | undefined): Record<string, string | string[]> | null {
  if (raw === undefined) return null
  let value: unknown
  try {
    value = JSON.parse(raw.toString())
  } catch {
    return null
  }
  if (value === null || typeof value !== 'object' || Array.isArray(value)) return null
  for (const item of Object.values(value)) {
    if (typeof item !== 'string' && !(Array.isArray(item) && item.every((part) => typeof part === 'string'))) return null
  }
  return value as Record<string, string | string[]>
}
