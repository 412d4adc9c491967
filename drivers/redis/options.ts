import type { Cluster, Redis } from 'ioredis'
import { InvalidOptionError } from '../../lib/core/errors.js'
import { booleanOption, integerOption, MAX_TIMER_MS } from '../../lib/core/validate.js'

export interface RedisPrefilterOptions {
  /**
   * An ioredis `Redis` or `Cluster`. It stays yours: the pre-filter defines its four scripts on it
   * (once, see scripts.ts) and never quits it. For the fail-open promise to hold during an outage,
   * configure it not to queue commands forever (e.g. `enableOfflineQueue: false`); `timeout` bounds
   * each call regardless. A command whose answer was lost with its connection may run again when
   * ioredis sends it on the next one (`autoResendUnfulfilledCommands`, a Cluster's retries): the
   * scripts expect it, and a request's markers carry its token so that it knows them for its own.
   */
  client: Redis | Cluster
  /**
   * Namespace of every key the pre-filter writes (`${prefix}:{tag}`). Without braces: a brace would
   * move the cluster hash tag into the prefix and put every record in one slot.
   * @defaultValue 'idem'
   */
  prefix?: string
  /**
   * Longest wait for one Redis operation, in ms; a slower answer rejects with
   * `FST_IDEMPOTENCY_PREFILTER_TIMEOUT`, and the request falls through to the store. Keep it well
   * below a store round trip: a pre-filter slower than the store only adds latency.
   * @defaultValue 50
   */
  timeout?: number
  /**
   * Send the operations that requests start in the same event-loop turn as one pipeline (one write
   * to Redis) instead of one write per command. Each operation keeps its own atomic script, reply and
   * error. Applies to a standalone client only: a Cluster client always gets each command on its own
   * (see pipelining.ts). `false` is for comparing the two on your own infrastructure.
   * @defaultValue true
   */
  pipeline?: boolean
}

export interface ResolvedPrefilterOptions {
  readonly client: Redis | Cluster
  readonly prefix: string
  readonly timeout: number
  readonly pipeline: boolean
}

const MAX_PREFIX_LENGTH = 256

export function resolvePrefilterOptions (options: RedisPrefilterOptions): ResolvedPrefilterOptions {
  if (options === null || typeof options !== 'object') {
    throw new InvalidOptionError('redisPrefilter options', 'an object with at least { client }', options)
  }
  return Object.freeze({
    client: resolveClient(options.client),
    prefix: resolvePrefix(options.prefix),
    timeout: integerOption('redisPrefilter option "timeout"', options.timeout, 50, 1, MAX_TIMER_MS, 'ms'),
    pipeline: booleanOption('redisPrefilter option "pipeline"', options.pipeline, true)
  })
}

function resolveClient (client: unknown): Redis | Cluster {
  const candidate = client as { defineCommand?: unknown, hgetallBuffer?: unknown } | null
  if (candidate === null || typeof candidate !== 'object' ||
      typeof candidate.defineCommand !== 'function' || typeof candidate.hgetallBuffer !== 'function') {
    throw new InvalidOptionError('redisPrefilter option "client"', 'an ioredis Redis or Cluster instance', client)
  }
  return client as Redis | Cluster
}

function resolvePrefix (prefix: unknown): string {
  if (prefix === undefined) return 'idem'
  if (typeof prefix !== 'string' || prefix.length === 0 || prefix.length > MAX_PREFIX_LENGTH ||
      prefix.includes('{') || prefix.includes('}')) {
    throw new InvalidOptionError('redisPrefilter option "prefix"',
      `a non-empty string of at most ${MAX_PREFIX_LENGTH} characters without braces`, prefix)
  }
  return prefix
}
