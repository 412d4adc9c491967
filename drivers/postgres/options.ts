import type { Sql } from 'postgres'
import { InvalidOptionError } from '../../lib/core/errors.js'
import { callbackOption, integerOption, MAX_TIMER_MS } from '../../lib/core/validate.js'
import type { DatabaseClient } from './client.js'
import { nodePostgresClient, type NodePostgresPool } from './node-postgres.js'
import { resolveOutboxOptions, type OutboxOptions, type ResolvedOutboxOptions } from './outbox.js'
import { postgresJsClient } from './postgres-js.js'

/**
 * A porsager `postgres` client. Typed loosely on its custom types (`Sql<any>`): a client created
 * with `types: { ... }` is a different `Sql<T>`, and the driver uses none of them.
 */
export type PostgresClient = Sql<any>

/** Where the records live. */
export interface TableOptions {
  /** Schema of the table; created by `migrate` when missing. @defaultValue 'public' */
  schema?: string
  /** Name of the table. @defaultValue 'idempotency_records' */
  table?: string
}

/**
 * A node-postgres (`pg`) Pool: `new pg.Pool(…)`, or `fastify.pg.pool` from @fastify/postgres.
 * Typed by the parts the driver uses, so these types load without @types/pg.
 */
export type NodePostgresPoolLike = NodePostgresPool

export interface PostgresStoreOptions extends TableOptions {
  /**
   * A `postgres` (porsager) client. It stays yours: the store never ends it, and `close()` only
   * stops the store's own timer. Exactly one of `sql` and `pool`.
   */
  sql?: PostgresClient
  /**
   * A node-postgres Pool (`new pg.Pool(…)`, or `fastify.pg.pool`). It stays yours: the store
   * never ends it. When the pool has no 'error' listener, the store adds one (an idle client
   * whose connection dies is emitted there, and an EventEmitter without a listener would throw
   * it and end the process); the errors go to `onBackgroundError` as task 'connection'.
   * Exactly one of `sql` and `pool`.
   */
  pool?: NodePostgresPoolLike
  /**
   * How often expired records are purged in the background, in ms; 0 disables the timer (call
   * `purgeExpired()` yourself, e.g. from a cron job). The timer is unref'd and stopped by `close()`.
   * @defaultValue 60_000
   */
  purgeInterval?: number
  /**
   * Most records one purge statement deletes: each batch is a short statement of its own, so a
   * purge never holds many row locks or a long transaction. The default limit of `purgeExpired()`.
   * @defaultValue 1000
   */
  purgeBatch?: number
  /**
   * Enables the transactional outbox (`request.idempotency.enqueue`): `deliver` sends one message,
   * after the transaction that enqueued it committed, or from the worker (`startReconciler`,
   * `deliverOutbox`) after a crash. See OutboxOptions.
   */
  outbox?: OutboxOptions
  /**
   * Receives the errors of the store's background work, which has no request to fail: the purge
   * timer, and the outbox delivery started after a commit (a failed delivery is also kept on its
   * message, `last_error`, and retried). Pass your logger, e.g. `(err, task) => app.log.error({ err, task })`.
   * @defaultValue none (the next purge tick or worker pass retries)
   */
  onBackgroundError?: (error: unknown, task: BackgroundTask) => void
}

/**
 * What background work failed: the purge timer, an outbox delivery, an idle pooled connection
 * (node-postgres), the settlement listener's connection (lost, or not reopened yet: waiters poll
 * meanwhile), or a settlement notice that could not be sent (waiters learn of it later).
 */
export type BackgroundTask = 'purge' | 'outbox' | 'connection' | 'listener' | 'notify'

export interface ResolvedNames {
  readonly schema: string
  readonly table: string
}

export interface ResolvedStoreOptions extends ResolvedNames {
  readonly db: DatabaseClient
  /** The node-postgres pool, when that is the client (for its 'error' listener). */
  readonly pool: NodePostgresPool | null
  readonly purgeInterval: number
  readonly purgeBatch: number
  readonly outbox: ResolvedOutboxOptions | null
  readonly onBackgroundError: ((error: unknown, task: BackgroundTask) => void) | null
}

export const DEFAULT_SCHEMA = 'public'
export const DEFAULT_TABLE = 'idempotency_records'

/** NAMEDATALEN - 1: PostgreSQL silently truncates longer identifiers, so two long names could collide. */
const MAX_IDENTIFIER_BYTES = 63

export function resolveStoreOptions (options: PostgresStoreOptions): ResolvedStoreOptions {
  if (options === null || typeof options !== 'object') {
    throw new InvalidOptionError('postgresStore options', 'an object with at least { sql } (postgres.js) or { pool } (node-postgres)', options)
  }
  if (options.sql === undefined && options.pool === undefined) {
    throw new InvalidOptionError('postgresStore option "sql" or "pool"', 'a postgres (porsager) client as { sql }, or a node-postgres Pool as { pool }', undefined)
  }
  const pool = options.pool === undefined ? null : resolvePool('postgresStore option "pool"', options.pool)
  if (pool !== null && options.sql !== undefined) {
    throw new InvalidOptionError('postgresStore options', 'either { sql } (postgres.js) or { pool } (node-postgres), not both', options)
  }
  return Object.freeze({
    db: pool === null ? postgresJsClient(resolveClient('postgresStore option "sql"', options.sql)) : nodePostgresClient(pool),
    pool,
    ...resolveNames(options, 'postgresStore'),
    purgeInterval: integerOption('postgresStore option "purgeInterval"', options.purgeInterval, 60_000, 0, MAX_TIMER_MS),
    purgeBatch: integerOption('postgresStore option "purgeBatch"', options.purgeBatch, 1000, 1, MAX_TIMER_MS),
    outbox: resolveOutboxOptions(options.outbox),
    onBackgroundError: callbackOption('postgresStore option "onBackgroundError"', options.onBackgroundError)
  })
}

export function resolveNames (options: TableOptions, caller: string): ResolvedNames {
  return {
    schema: identifier(`${caller} option "schema"`, options.schema, DEFAULT_SCHEMA),
    table: identifier(`${caller} option "table"`, options.table, DEFAULT_TABLE)
  }
}

/**
 * The client `migrate` and the store run on: a postgres.js client or a node-postgres Pool (told
 * apart by shape: a postgres.js client is a function with `begin` and `unsafe`; a Pool an object
 * with `connect` and `query`).
 */
export function resolveDatabase (name: string, client: unknown): DatabaseClient {
  if (typeof client === 'function') return postgresJsClient(resolveClient(name, client))
  if (typeof client === 'object' && client !== null && typeof (client as { connect?: unknown }).connect === 'function') {
    return nodePostgresClient(resolvePool(name, client))
  }
  throw new InvalidOptionError(name, 'a postgres (porsager) client, as returned by postgres(url), or a node-postgres Pool', client)
}

export function resolvePool (name: string, pool: unknown): NodePostgresPool {
  const candidate = pool as Partial<Record<'connect' | 'query' | 'on' | 'listenerCount', unknown>> | null
  if (typeof pool !== 'object' || pool === null || typeof candidate?.connect !== 'function' || typeof candidate.query !== 'function' ||
      typeof candidate.on !== 'function' || typeof candidate.listenerCount !== 'function') {
    throw new InvalidOptionError(name, 'a node-postgres Pool (new pg.Pool(...), or fastify.pg.pool from @fastify/postgres)', pool)
  }
  // A single Client has connect() too, but no release: one connection cannot give each request a transaction of its own.
  if (typeof (pool as { release?: unknown }).release === 'function' || !('totalCount' in pool)) {
    throw new InvalidOptionError(name, 'a node-postgres Pool, not a Client or PoolClient (each atomic-mode request needs a connection of its own)', pool)
  }
  return pool as unknown as NodePostgresPool
}

export function resolveClient (name: string, sql: unknown): PostgresClient {
  const client = sql as { begin?: unknown, unsafe?: unknown } | null
  if (typeof sql !== 'function' || typeof client?.begin !== 'function' || typeof client.unsafe !== 'function') {
    throw new InvalidOptionError(name, 'a postgres (porsager) client, as returned by postgres(url)', sql)
  }
  return sql as PostgresClient
}

function identifier (name: string, value: unknown, fallback: string): string {
  if (value === undefined) return fallback
  // postgres.js quotes `sql(name)` but reads a dot as a qualifier separator ("a.b" → "a"."b"), so a
  // dot would silently name another object; NUL cannot appear in an identifier at all.
  if (typeof value !== 'string' || value.length === 0 || value.includes('.') || value.includes('\0') ||
      Buffer.byteLength(value) > MAX_IDENTIFIER_BYTES) {
    throw new InvalidOptionError(name, `a non-empty identifier of at most ${MAX_IDENTIFIER_BYTES} bytes, without dots`, value)
  }
  return value
}
