import type { Cluster, Redis } from 'ioredis'

/**
 * The Lua scripts behind lookupOrMark, markInFlight, clearInFlight and remember. Each touches one key
 * (KEYS[1], the record's hash, see keys.ts), so Redis runs it atomically and Cluster routes it to one
 * slot. Field names match FIELD in keys.ts.
 *
 * An in-flight marker names its owner: a token drawn once per request (prefilter.ts). A command can
 * run twice: when its answer is lost with the connection, ioredis sends it again on the next one
 * (its offline queue, `autoResendUnfulfilledCommands`; a Cluster client retries it on another
 * connection). The second delivery of a request's lookup-or-mark then finds the marker the first one
 * wrote, and the token is how it knows that marker for its own rather than another request's; it
 * is also what keeps a request's clear from removing another request's marker. A marker without an
 * owner (written by a pre-filter of an earlier version of this package, during a rolling deploy) is
 * another request's to every caller, and its ttl ends it.
 */

/**
 * Command names the scripts are registered under on the user's client. A name stands for one script
 * with one argument list: defineScripts keeps a command already defined under a name (another
 * pre-filter on the same client, possibly of another version of this package), so a script whose
 * arguments differ from another version's has a name of its own.
 */
export const COMMAND = Object.freeze({
  lookupOrMark: 'idempotencyLookupOrMarkOwned',
  lookupOrMarkBuffer: 'idempotencyLookupOrMarkOwnedBuffer',
  mark: 'idempotencyMarkOwned',
  clear: 'idempotencyClearOwnedAnnounced',
  remember: 'idempotencyRememberAnnounced'
})

/**
 * KEYS[1] = record hash; ARGV = algorithm, digest (bytes), ttl ms, owner token. Returns the hash's
 * fields and values as they were (what a lookup returns), or an empty list when the caller holds the
 * marker: written now, or found there with the caller's token.
 */
const LOOKUP_OR_MARK = `
-- Whatever is there is the answer, as for a plain lookup (HGETALL is what lookup runs too)...
local fields = redis.call('HGETALL', KEYS[1])
if #fields > 0 then
  -- ...but for the caller's own marker: this is a second delivery of the same command (its first
  -- answer was lost), and the marker its first delivery wrote is still the caller's, not another
  -- request in flight. Its ttl still runs from the first delivery: it ends no later than it would have.
  local marker = redis.call('HMGET', KEYS[1], 'state', 'owner')
  if marker[1] == 'in_progress' and marker[2] == ARGV[4] then return {} end
  return fields
end
-- Nothing: the caller is about to ask the store, and marks the key in flight meanwhile, for the
-- duplicates arriving from now on (lib/core/prefilter.ts says what they may make of it).
redis.call('HSET', KEYS[1], 'state', 'in_progress', 'alg', ARGV[1], 'digest', ARGV[2], 'owner', ARGV[4])
-- Bounded by the lease: a marker whose request never came back delays retries at most this long.
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {}
`

/** KEYS[1] = record hash; ARGV = algorithm, digest (bytes), ttl ms, owner token. Returns 1 if written, 0 if not. */
const MARK = `
-- A completed record is never replaced by a marker: it must keep replaying (and a marker over it
-- would turn replays into 409s for a whole lease).
if redis.call('HGET', KEYS[1], 'state') == 'completed' then return 0 end
-- Start from an empty hash, so no field of an older marker survives. A marker of another request
-- goes too: the store has just handed the key to the caller, whose marker this now is.
redis.call('DEL', KEYS[1])
-- The marker: state, the owner's fingerprint (so a duplicate with another request gets 422) and
-- the owner's token (so only the owner clears it).
redis.call('HSET', KEYS[1], 'state', 'in_progress', 'alg', ARGV[1], 'digest', ARGV[2], 'owner', ARGV[4])
-- Bounded by the owner's lease: a stale marker (crashed owner) delays retries at most this long.
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
`

/**
 * KEYS[1] = record hash; ARGV = owner token, settlement channel, settlement digest. Returns 1 if the
 * caller's marker was deleted, 0 otherwise.
 */
const CLEAR = `
-- Only the caller's own marker goes. Another request's marker stays (its owner may be running; the
-- caller's own may have expired and been replaced meanwhile), a marker without an owner too (its
-- ttl ends it), and so does a completed record copied in meanwhile, which keeps replaying.
local marker = redis.call('HMGET', KEYS[1], 'state', 'owner')
if marker[1] == 'in_progress' and marker[2] == ARGV[1] then
  redis.call('DEL', KEYS[1])
  -- The owner gave the key back: duplicates waiting on the marker, in any process, are told.
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return 1
end
-- Nothing, someone else's marker, or a completed record: left alone.
return 0
`

/**
 * KEYS[1] = record hash; ARGV = algorithm, digest (bytes), status code, headers (JSON),
 * retained ('1' or '0'), body (bytes; empty when not retained), ttl ms, settlement channel,
 * settlement digest.
 */
const REMEMBER = `
-- Replace whatever is there (usually the owner's marker) as one unit.
local was = redis.call('HGET', KEYS[1], 'state')
redis.call('DEL', KEYS[1])
-- The committed record and the fingerprint it answers for (a mismatch must still get 422).
redis.call('HSET', KEYS[1], 'state', 'completed', 'alg', ARGV[1], 'digest', ARGV[2], 'status', ARGV[3], 'headers', ARGV[4])
-- The body only when the store retained it; a missing field means "not retained" (null body),
-- which is distinct from an empty body (a present, empty field).
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'body', ARGV[6]) end
-- Never outlive the store's record: ttl is at most its remaining retention.
redis.call('PEXPIRE', KEYS[1], ARGV[7])
-- A marker was there: duplicates may be waiting on it, in any process, and are told. A route
-- without wait writes no marker, and its copies publish nothing.
if was == 'in_progress' then redis.call('PUBLISH', ARGV[8], ARGV[9]) end
return 1
`

/** An ioredis command's callback: its own reply, or its own error. */
export type Done<T> = (error: Error | null | undefined, reply?: T) => void

/**
 * The commands the pre-filter sends, as ioredis defines them on a client and on its pipelines alike,
 * each called with a callback (a client's also return a promise, a pipeline's the pipeline). The
 * Buffer variants reply with field names and values as Buffers; ioredis turns HGETALL's reply into an
 * object.
 */
export interface ScriptedCommands {
  hgetallBuffer: (key: string, done: Done<Record<string, Buffer>>) => unknown
  [COMMAND.lookupOrMarkBuffer]: (key: string, algorithm: string, digest: Buffer, ttlMs: number, owner: string, done: Done<Buffer[]>) => unknown
  [COMMAND.mark]: (key: string, algorithm: string, digest: Buffer, ttlMs: number, owner: string, done: Done<unknown>) => unknown
  [COMMAND.clear]: (key: string, owner: string, channel: string, settlement: string, done: Done<unknown>) => unknown
  [COMMAND.remember]: (key: string, algorithm: string, digest: Buffer, status: number, headers: string,
    retained: '1' | '0', body: Buffer, ttlMs: number, channel: string, settlement: string, done: Done<unknown>) => unknown
}

/**
 * Defines the scripts on `client` unless it already has commands by these names (another
 * pre-filter on the same client defined them: defining again would only re-hash the same Lua;
 * rate-limit's Redis store pattern). ioredis runs them with EVALSHA and falls back to EVAL after a
 * NOSCRIPT (e.g. after SCRIPT FLUSH or on a fresh cluster node).
 */
export function defineScripts (client: Redis | Cluster): void {
  const commands = client as unknown as Record<string, unknown>
  for (const [name, lua] of [[COMMAND.lookupOrMark, LOOKUP_OR_MARK], [COMMAND.mark, MARK], [COMMAND.clear, CLEAR], [COMMAND.remember, REMEMBER]] as const) {
    if (typeof commands[name] !== 'function') client.defineCommand(name, { numberOfKeys: 1, lua })
  }
}
