import type { ConnectionState } from './dropped-connection.js'

/*
 * What the driver needs of a PostgreSQL client, so that one driver serves two: postgres.js
 * (postgres-js.ts) and node-postgres (node-postgres.ts). Every statement text is fixed and built
 * once; a call binds values only. Rows come back as arrays (read positionally), in the types the
 * statements cast their columns to: text, boolean, float8, int4, bytea (Buffer), jsonb (parsed),
 * timestamptz (Date).
 */

/** What the statements bind: strings, numbers, the digest and body bytes, null (no body). */
export type Value = string | number | boolean | Buffer | null

export interface Rows {
  /** Each row's columns, in SELECT order. */
  readonly rows: readonly unknown[][]
  /** Rows the statement inserted, updated, deleted or returned. */
  readonly count: number
}

/** Runs statements: the pool (autocommit, lease mode) or one transaction's connection. */
export interface Queryable {
  /** One statement, prepared once per connection (named), sent as soon as this is called. */
  query (text: string, values: readonly Value[]): Promise<Rows>
}

/** A transaction's connection, inside {@link DatabaseClient.transaction}'s body. */
export interface TransactionConnection extends Queryable {
  /** Set the moment the client reports this connection gone; from then on nothing is sent on it. */
  readonly connection: ConnectionState
  /**
   * `statement` with `before` ahead of it and `after` behind it, in that order on the wire: one
   * round trip where the client pipelines (postgres.js), three in a row where it does not
   * (node-postgres queues one query at a time). `before` and `after` take no parameters.
   */
  around<T> (before: string, statement: () => Promise<T>, after: string): Promise<T>
  /**
   * The handle given to the application (atomic mode's `request.idempotency.sql`, a transactional
   * step's argument): the client's own transaction type, refusing every query once `end()` was
   * called or the connection was lost. Recognised by {@link DatabaseClient.connectionOf}.
   */
  guarded (): { readonly handle: unknown, end (): void }
  /** One statement without parameters, not prepared (SET, DDL): the simple query protocol. */
  simple (text: string): Promise<void>
}

export interface TransactionHooks {
  readonly commitSent?: () => void
  readonly prelude?: string
}

export interface DatabaseClient extends Queryable {
  /** Which client library this is, for messages. */
  readonly library: 'postgres' | 'pg'
  /** Connections the pool may open, when the client says. */
  readonly maxConnections: number | undefined
  /** `name` as a quoted identifier. */
  identifier (name: string): string
  /**
   * BEGIN, `body`, then COMMIT if it resolved or ROLLBACK if it threw. Once the connection is
   * lost (dropped-connection.ts) nothing more is sent on it, ROLLBACK and COMMIT included; the
   * promise then rejects with the connection's error. `commitSent` is called just before COMMIT.
   * `prelude` (no parameters) is sent right after BEGIN, in the same round trip where the client
   * does not pipeline (node-postgres: one simple query `BEGIN; prelude`); a first
   * `around(prelude, …)` then does not send it again.
   */
  transaction<T> (body: (tx: TransactionConnection) => Promise<T>, hooks?: TransactionHooks): Promise<T>
  /** The connection behind a handle from `guarded()`, or null for anything else. */
  connectionOf (handle: unknown): Queryable | null
  /** True for an error the server sent on a live session (it rolled the statement back). */
  isServerError (err: unknown): boolean
}
