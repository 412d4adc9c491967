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
   * The handle given to the application (atomic mode's `request.idempotency.sql`, a transactional
   * step's argument): the client's own transaction type (see {@link Guard}). Recognised by
   * {@link DatabaseClient.connectionOf}. Once its guard has ended, `query` and `simple`
   * wait for the handle's queries still in flight to be answered and checked before they send
   * anything, so the driver's own statements never share the wire with the handle's.
   */
  guarded (): Guard
  /**
   * Text without parameters, not prepared (SET, DDL, transaction control): the simple query
   * protocol, so it may hold several statements.
   */
  simple (text: string): Promise<void>
}

/**
 * What the driver keeps of a handle it gave out. The handle refuses every query once `end()` was
 * called (the transaction is the driver's again), once the connection was lost, and once the
 * transaction it was given in is no longer the connection's: ended through the handle itself
 * (COMMIT, ROLLBACK, PREPARE TRANSACTION, AND CHAIN) or taken over by a BEGIN sent through it.
 *
 * How the guards know, without reading any SQL: every handle query goes through the extended
 * query protocol, whose Parse message carries one statement ("The query string contained in a
 * Parse message cannot include more than one SQL statement; else a syntax error is reported",
 * PostgreSQL docs, Frontend/Backend Protocol, Extended Query), so the server itself refuses a text
 * that smuggles a second statement. Handle queries are sent one at a time, and after each the
 * guard reads what the server answered: the command tag (CommandComplete), the transaction status
 * (ReadyForQuery: 'I' idle, 'T' in a transaction block, 'E' in a failed one; node-postgres only)
 * and, where those leave a doubt, {@link TRANSACTION_PROBE}. The next handle query is sent only
 * after that check, so none runs outside the transaction it was meant for.
 */
export interface Guard {
  readonly handle: unknown
  /**
   * Ends the handle's part: queries not yet sent are refused from now on. Resolves (never rejects)
   * once the queries in flight have been answered and checked: with how the transaction ended
   * under the handle, or null while it is still the transaction the driver began (also when the
   * connection was lost: see `connection.lost`).
   */
  end (): Promise<Ended | null>
}

export interface Ended {
  /** What ended it, for the error's cause. */
  readonly reason: Error
  /**
   * The client has taken the connection back: postgres.js returns a transaction's connection to its
   * pool at the first ReadyForQuery that reports the session idle (src/connection.js), so once the
   * handler's COMMIT or ROLLBACK left it idle, another query of the application may be running on
   * it. Nothing more may be sent through the transaction then, not even ROLLBACK. False when the
   * connection is still the transaction's (node-postgres always; postgres.js after AND CHAIN).
   */
  readonly released: boolean
}

/** The custom setting that marks the driver's transaction (TRANSACTION_MARK, TRANSACTION_PROBE). */
export const MARK_SETTING = 'fastify_idempotency.transaction'

/**
 * Sent in every transaction that hands out a guarded handle, before the handle's first query,
 * unless the transaction's own first statement set it already (atomic mode's claim, with
 * `set_config(MARK_SETTING, 'open', true)`, the same as SET LOCAL: statements.ts). A
 * setting made with SET LOCAL lasts "only till the end of the current transaction" (PostgreSQL
 * docs, SET), also when COMMIT AND CHAIN or ROLLBACK AND CHAIN starts a new one right away (the
 * chain keeps the transaction's characteristics, isolation level and access mode, not its
 * settings), and ROLLBACK TO SAVEPOINT keeps it (it only undoes what came after the savepoint).
 * A custom setting (its name has a dot) needs no extension; SET LOCAL is also what Citus forwards.
 */
export const TRANSACTION_MARK = `set local ${MARK_SETTING} = 'open'`

/**
 * Its first column is true exactly while the connection is still inside the transaction that sent
 * TRANSACTION_MARK; false or null once that transaction ended, whatever came after it (idle, a
 * chained transaction). In a failed transaction block it fails with 25P02: then the transaction is
 * still the driver's (aborted, and rolled back when the driver ends it). Its second column tells
 * what the connection is in once that transaction ended: `now() = statement_timestamp()` holds for
 * the first statement of a transaction, so for the probe itself only when it runs in a transaction
 * of its own (autocommit: the session is idle); in a chained transaction now() is the time of the
 * COMMIT AND CHAIN that started it. Sent with the simple query protocol (one fixed statement,
 * nothing to smuggle): with the extended one, the implicit transaction of an idle session starts
 * with the Parse or Bind message, before the Execute message that sets the statement's time, and
 * the two never match.
 *
 * Needed where the tag and the status leave a doubt: ROLLBACK TO SAVEPOINT and ROLLBACK AND CHAIN
 * (and COMMIT AND CHAIN in a failed transaction) all complete with the tag ROLLBACK and leave the
 * status 'T'; and postgres.js reports no status at all, while a statement that failed may have
 * ended the transaction (a COMMIT whose deferred constraint fails rolls back and leaves the session
 * idle; a failed PREPARE TRANSACTION "becomes a ROLLBACK"). `now() = statement_timestamp()` would
 * not do alone: in a chained transaction both still differ, as in the driver's own.
 */
export const TRANSACTION_PROBE = `select current_setting('${MARK_SETTING}', true) = 'open', now() = statement_timestamp()`

/** SQLSTATE in_failed_sql_transaction: the probe's answer inside an aborted (still open) transaction. */
export const IN_FAILED_TRANSACTION = '25P02'

/** Command tags after which the transaction the statement ran in is over (AND CHAIN included: a new one follows). */
export const ENDING_TAGS: ReadonlySet<string> = new Set(['COMMIT', 'PREPARE TRANSACTION'])

/**
 * Command tags of a transaction started inside the driver's: PostgreSQL answers BEGIN inside a
 * transaction block with a warning and changes nothing (PostgreSQL docs, BEGIN), so the driver's
 * transaction is intact, but whoever sent it (an ORM's `transaction()`) will COMMIT next.
 */
export const STARTING_TAGS: ReadonlySet<string> = new Set(['BEGIN', 'START TRANSACTION'])

/** The tag of ROLLBACK, ABORT, ROLLBACK TO SAVEPOINT, the AND CHAIN forms, and of COMMIT in a failed transaction. */
export const ROLLBACK_TAG = 'ROLLBACK'

/** What a guard refuses a handle query with, whichever the client: one set of messages and codes for a handler to check. */
export const refusals = {
  /** The driver ended the handle's part (the transaction committed or rolled back, or is about to). */
  ended: (): Error => new Error("fastify-idempotency: this request's transaction has ended (committed or rolled back); run no more queries through request.idempotency.sql"),
  /** The code postgres.js gives a query on a closed connection, so a handler's own checks match on either client. */
  lost: (cause: unknown): Error => Object.assign(
    new Error("fastify-idempotency: the connection of this request's transaction closed, so PostgreSQL rolled the transaction back; nothing more is sent through request.idempotency.sql", { cause }),
    { code: 'CONNECTION_CLOSED' }
  ),
  /** The transaction ended under the handle. */
  endedEarly: (cause: Error): Error => Object.assign(
    new Error("fastify-idempotency: request.idempotency.sql ended the request's transaction itself (COMMIT, ROLLBACK or PREPARE TRANSACTION) before its response was recorded, so nothing more is sent through it: the request fails and its key is held for the reconciler", { cause }),
    { code: 'FST_IDEMPOTENCY_TRANSACTION_ENDED' }
  ),
  /** A BEGIN or START TRANSACTION went through the handle. */
  transactionControl: (): Error => new Error(
    "fastify-idempotency: request.idempotency.sql is already inside the request's transaction, which the store commits with the recorded response; a BEGIN sent through it starts nothing (an ORM's transaction() sends one), and the COMMIT meant to follow would end the request's transaction early, so nothing more is sent through it: write through it directly, and use SAVEPOINT / ROLLBACK TO SAVEPOINT for a partial rollback"
  )
}

/** Why a transaction is no longer the driver's: the cause of what `Guard.end()` and the refusals report. */
export const endedBy = (how: string, cause?: unknown): Error =>
  new Error(`fastify-idempotency: the transaction was ended through request.idempotency.sql (${how})`, cause === undefined ? undefined : { cause })

export interface TransactionHooks {
  readonly commitSent?: () => void
  /** The body's first statement sets MARK_SETTING itself: TRANSACTION_MARK is not sent. */
  readonly marked?: boolean
}

/** A connection of its own that LISTENs on one channel (settlements.ts). */
export interface Listening {
  /** Ends the connection; nothing is reported lost after this. */
  close (): Promise<void>
}

/** What {@link DatabaseClient.listen} reports. */
export interface ListenHandlers {
  /** A NOTIFY on the channel, with its payload. */
  notice (payload: string): void
  /** The connection ended or failed: no notice arrives through it any more. Called at most once. */
  lost (err: Error): void
}

/**
 * The application_name of the listening connection, so an operator can tell it in
 * pg_stat_activity: the application's own with ` (idempotency listener)` after it, when it set one.
 */
export function listenerName (applicationName: unknown): string {
  return typeof applicationName === 'string' && applicationName !== '' ? `${applicationName} (idempotency listener)` : 'fastify-idempotency listener'
}

export interface DatabaseClient extends Queryable {
  /** Which client library this is, for messages. */
  readonly library: 'postgres' | 'pg'
  /** Connections the pool may open, when the client says. */
  readonly maxConnections: number | undefined
  /** `name` as a quoted identifier. */
  identifier (name: string): string
  /**
   * BEGIN, `body`, then COMMIT if it resolved or ROLLBACK if it threw, each once a guarded
   * handle's queries have all been answered (its part is ended then, if the body has not). Once
   * the connection is lost (dropped-connection.ts) nothing more is sent on it, ROLLBACK and COMMIT
   * included; the promise then rejects with the connection's error. The same once the client has
   * taken the connection back (Ended.released): the promise rejects with what the body threw, or
   * an error if it returned. `commitSent` is called just before COMMIT.
   */
  transaction<T> (body: (tx: TransactionConnection) => Promise<T>, hooks?: TransactionHooks): Promise<T>
  /** The connection behind a handle from `guarded()`, or null for anything else. */
  connectionOf (handle: unknown): Queryable | null
  /** True for an error the server sent on a live session (it rolled the statement back). */
  isServerError (err: unknown): boolean
  /**
   * Opens a connection of its own, outside the pool, with the client's settings, and LISTENs on
   * `channel` (a quoted identifier); resolves once the LISTEN is in place. Null when the client
   * cannot open one (a pool-like object without node-postgres's `Client`).
   */
  listen (channel: string, handlers: ListenHandlers): Promise<Listening> | null
}
