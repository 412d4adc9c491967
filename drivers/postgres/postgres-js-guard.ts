import { readFile } from 'node:fs'
import type { TransactionSql } from 'postgres'
import {
  endedBy, ENDING_TAGS, IN_FAILED_TRANSACTION, refusals, ROLLBACK_TAG, STARTING_TAGS, TRANSACTION_PROBE, type Ended, type Guard
} from './client.js'
import { isConnectionError, type ConnectionState } from './dropped-connection.js'

/**
 * The TransactionSql given to the application in atomic mode (`request.idempotency.sql`) and to a
 * transactional step: the transaction's own handle, so the handler's queries (its own, or an ORM's
 * on top of it) commit or roll back with the recorded response. What it refuses, and why:
 *
 * - every query once the driver ended the handle's part (`end()`): postgres.js keeps running
 *   queries on a transaction handle after its transaction ended, on the connection the transaction
 *   used, which by then is back in the pool: a handler still writing after a rollback (its client
 *   went away) would commit those writes outside any transaction, or inside another request's;
 * - every query once the transaction's connection is lost (`connection`), since postgres.js would
 *   write it to the closed socket and crash the process (dropped-connection.ts): a query failing
 *   with a connection error marks the connection lost before the code awaiting it resumes, and the
 *   queries sent and not yet answered are refused at that moment (postgres.js never answers one it
 *   had queued behind a statement in flight);
 * - every query once the transaction ended under the handle, or a BEGIN went through it (client.ts,
 *   Guard, for how that is known);
 * - `notify()` (another connection), `prepare()` (it would turn the driver's COMMIT into a PREPARE
 *   TRANSACTION), and COPY streams (`readable()`, `writable()`: see {@link line}).
 *
 * A query is checked when it is SENT (postgres.js sends a query when it is first awaited, so a
 * query built before the end and awaited after is refused too), and the same holds for the handles
 * of its savepoints (`sql.savepoint(fn)`) and for `sql.file()`.
 *
 * postgres.js reports no transaction status, and pipelines: a query awaited while another is in
 * flight is written behind it at once, so a statement queued behind a COMMIT would run outside the
 * transaction, in autocommit, before anyone read the COMMIT's tag. So the handle's queries are sent
 * one at a time: each only once the one before was answered and its answer checked (its command
 * tag; after a failure, or a tag that ends or may have ended the transaction, the probe).
 *
 * And postgres.js hands a transaction's connection back to its pool at the first ReadyForQuery
 * that reports the session idle, unless another query is already in line on it (src/connection.js,
 * `ReadyForQuery`): after a handler's COMMIT, anything sent through the transaction may land in
 * another query's session, or inside another transaction. So the probe is written from within the
 * answer itself, while postgres.js is still handling that ReadyForQuery: in line behind the
 * statement, on the connection that is still the transaction's. Its own answer then says whether
 * the session is idle (and the connection gone back to the pool: `released`), or in a new, chained
 * transaction (still the transaction's connection, which the driver rolls back).
 */
export function guardTransaction (tx: TransactionSql<any>, connection: ConnectionState = connectionUnwatched()): { sql: TransactionSql<any>, end: Guard['end'] } {
  const transaction: Guarded = {
    closed: false,
    ended: null,
    released: false,
    foreign: false,
    connection,
    unanswered: new Set(),
    tail: Promise.resolve(),
    probe: () => probe(tx, transaction)
  }
  connection.onLost((err) => {
    for (const query of [...transaction.unanswered]) query.reject(refusals.lost(err))
    transaction.unanswered.clear()
  })
  return {
    sql: guardHandle(tx, transaction),
    end () {
      transaction.closed = true
      // Queries still in line are refused when their turn comes; `tail` settles after the last.
      return transaction.tail.then((): Ended | null => transaction.ended === null ? null : { reason: transaction.ended, released: transaction.released })
    }
  }
}

interface Guarded {
  /** The driver ended the handle's part. */
  closed: boolean
  /** How the transaction ended under the handle, once it did. */
  ended: Error | null
  /** postgres.js took the connection back (client.ts, Ended). */
  released: boolean
  /** A BEGIN or START TRANSACTION went through the handle. */
  foreign: boolean
  readonly connection: ConnectionState
  /** Queries sent and not yet answered (the probe's too). */
  readonly unanswered: Set<PendingQuery>
  /** Settles once the last query in line was answered (or refused) and checked; never rejects. */
  tail: Promise<void>
  /** Asks the server whether the transaction is still the driver's (TRANSACTION_PROBE). */
  readonly probe: () => Promise<void>
}

/** For a caller that does not track its connection: never lost, so the guard only fences the end. */
function connectionUnwatched (): ConnectionState {
  return { lost: null, lose: () => {}, onLost: () => {} }
}

type Handler = ((query: PendingQuery) => unknown) & { debug?: unknown }

/** The parts of a postgres.js Query the guard uses (src/query.js). */
interface PendingQuery extends Promise<unknown> {
  handler: Handler
  strings: readonly string[]
  options: { simple?: boolean }
  /** Set by `readable()` and `writable()` (COPY). */
  streaming?: boolean
  /** Set by postgres.js when the query was cancelled before it was sent; it is then never answered. */
  cancelled?: unknown
  /** Set by postgres.js when it writes the query to a connection (src/connection.js, `execute`). */
  state?: unknown
  executed?: boolean
  resolve (value: unknown): void
  reject (error: unknown): void
  execute (): PendingQuery
}

/** Why a query may not be sent now, or null. */
function refusal (transaction: Guarded): Error | null {
  if (transaction.closed) return refusals.ended()
  if (transaction.ended !== null) return refusals.endedEarly(transaction.ended)
  const lost = transaction.connection.lost
  if (lost !== null) return refusals.lost(lost)
  return transaction.foreign ? refusals.transactionControl() : null
}

function guardHandle (handle: TransactionSql<any>, transaction: Guarded): TransactionSql<any> {
  const check = (): void => {
    const refused = refusal(transaction)
    if (refused !== null) throw refused
  }
  return new Proxy(handle, {
    apply (target, thisArg, args) {
      check()
      return fenced(Reflect.apply(target as unknown as (...a: unknown[]) => unknown, thisArg, args), transaction)
    },
    get (target, property, receiver) {
      const value: unknown = Reflect.get(target, property, receiver)
      if (typeof value !== 'function') return value
      const method = value as (...a: unknown[]) => unknown
      if (property === 'savepoint') return (...args: unknown[]) => { check(); return savepoint(target, method, args, transaction) }
      if (property === 'file') return (...args: unknown[]) => { check(); return fencedFile(target, method.apply(target, args) as PendingQuery, String(args[0]), transaction) }
      if (property === 'notify') {
        // eslint-disable-next-line no-template-curly-in-string -- the message shows the tagged template to write
        return () => { throw new Error('fastify-idempotency: notify() on request.idempotency.sql runs on another connection, outside the transaction (postgres.js); use sql`select pg_notify(${channel}, ${payload})` so it is sent when the transaction commits') }
      }
      if (property === 'prepare') {
        return () => { throw new Error("fastify-idempotency: prepare() on request.idempotency.sql would make the store's COMMIT of the request's transaction a PREPARE TRANSACTION, which commits nothing; the store commits the transaction with the recorded response") }
      }
      return (...args: unknown[]) => { check(); return fenced(method.apply(target, args), transaction) }
    }
  })
}

/**
 * `sql.savepoint(fn)`: the savepoint's own handle is guarded by the same transaction. postgres.js
 * sends SAVEPOINT and, when `fn` fails, ROLLBACK TO SAVEPOINT itself, through the savepoint's own
 * handler: neither can end the transaction, but they are kept in line with the handle's queries.
 * SAVEPOINT is sent once those before it were answered and checked; ROLLBACK TO SAVEPOINT once
 * `fn`'s own queries still in line were (a query `fn` did not await would otherwise be sent after
 * the rollback it was meant to be undone by). Once the handle refuses queries (the transaction
 * ended, under the handle or by the driver, or its connection was lost), ROLLBACK TO SAVEPOINT is
 * not sent at all: the connection may be another session's by then. `fn`'s promise is left pending
 * instead (as the transaction's callback is, dropped-connection.ts), and the handler gets the error
 * from the promise returned here.
 */
function savepoint (target: TransactionSql<any>, method: (...a: unknown[]) => unknown, args: unknown[], transaction: Guarded): Promise<unknown> {
  // `sql.savepoint\`…\``: postgres.js would wrap it in a callback of its own, on its unguarded handle.
  const template = args[0] as { raw?: unknown } | null | undefined
  const forms = Array.isArray(template?.raw) ? [(handle: TransactionSql<any>) => (handle as unknown as (...a: unknown[]) => unknown)(...args)] : args
  return new Promise((resolve, reject) => {
    void transaction.tail.then(() => {
      const refused = refusal(transaction)
      if (refused !== null) return reject(refused)
      const guarded = forms.map((arg) => typeof arg !== 'function'
        ? arg
        : async (handle: TransactionSql<any>) => {
          try {
            const result = (arg as (sql: TransactionSql<any>) => unknown)(guardHandle(handle, transaction))
            return await (Array.isArray(result) ? Promise.all(result) : result)
          } catch (err) {
            await transaction.tail
            if (refusal(transaction) === null) throw err
            reject(err)
            return await new Promise<never>(() => {})
          }
        })
      ;(method.apply(target, guarded) as Promise<unknown>).then(resolve, reject)
    })
  })
}

function isQuery (value: unknown): value is PendingQuery {
  return value instanceof Promise && typeof (value as Partial<PendingQuery>).handler === 'function' && 'strings' in value
}

/** A query is sent through its `handler`: the fenced one puts it in line (see {@link line}). */
function fenced<T> (value: T, transaction: Guarded): T {
  if (!isQuery(value)) return value
  const send = value.handler
  value.handler = Object.assign((pending: PendingQuery) => { line(pending, send, transaction) }, { debug: send.debug })
  return value
}

/**
 * Sends `pending` through `send` once every handle query before it was answered and checked, and
 * if nothing is refused by then.
 *
 * Always with the extended query protocol (`options.simple = false`): `unsafe(text)` without
 * parameters, `.simple()` and `sql.file()` would otherwise send a Query message, whose text may hold
 * several statements ("SELECT 1; COMMIT"), run one after the other before any answer is read. A
 * COPY stream (`readable()`, `writable()`) needs the simple protocol (copy-in through the extended
 * one leaves postgres.js waiting for a ReadyForQuery the server only sends after a Sync that it
 * ignored during the copy), so it is refused rather than sent in a form that could smuggle a
 * statement past the check.
 */
function line (pending: PendingQuery, send: Handler, transaction: Guarded): void {
  const refused = refusal(transaction) ?? (pending.streaming === true ? copyRefused() : null)
  if (refused !== null) return pending.reject(refused)
  const previous = transaction.tail
  let checked!: () => void
  transaction.tail = new Promise((resolve) => { checked = resolve })
  void previous.then(() => {
    // Cancelled while in line: postgres.js rejected it, and would never answer it.
    if (pending.cancelled !== undefined && pending.cancelled !== null) return checked()
    const refused = refusal(transaction)
    if (refused !== null) {
      pending.reject(refused)
      return checked()
    }
    pending.options.simple = false
    watch(pending, transaction, checked)
    send(pending)
  })
}

const copyRefused = (): Error => new Error('fastify-idempotency: COPY streams (readable(), writable()) are not sent through request.idempotency.sql: they need the simple query protocol, in which one text can carry several statements; insert through the handle instead')

/**
 * Reads the answer of a query as postgres.js hands it over, before the query's own promise (or a
 * cursor's iterator) gets it: `resolve` and `reject` are what postgres.js calls (src/connection.js),
 * and a cursor replaces them with its own (src/query.js, `cursor()`), hence accessors that keep the
 * latest. A connection error marks the connection lost at once, before the code awaiting the query
 * resumes. `checked` is called once the answer was checked: at once for a plain tag, after the
 * probe for a failure or a ROLLBACK tag.
 */
function watch (pending: PendingQuery, transaction: Guarded, checked: () => void): void {
  let resolveNext = pending.resolve
  let rejectNext = pending.reject
  let answered = false
  const answer = (check: () => Promise<void> | undefined): void => {
    if (answered) return
    answered = true
    transaction.unanswered.delete(pending)
    const probing = check()
    if (probing === undefined) checked()
    else void probing.then(checked)
  }
  const resolve = (value: unknown): void => {
    answer(() => afterAnswer(value, transaction))
    resolveNext(value)
  }
  const reject = (err: unknown): void => {
    answer(() => {
      if (isConnectionError(err)) {
        transaction.connection.lose(err)
        return undefined
      }
      // A statement the server failed may have ended the transaction (a COMMIT whose deferred
      // constraint fails rolls back; a failed PREPARE TRANSACTION too), and postgres.js reports no
      // transaction status: the probe asks. An error of the client's own (a value it could not
      // serialize) was raised before anything reached the server.
      return (err as { name?: unknown } | null)?.name === 'PostgresError' ? transaction.probe() : undefined
    })
    rejectNext(err)
  }
  Object.defineProperty(pending, 'resolve', { configurable: true, get: () => resolve, set: (fn: (value: unknown) => void) => { resolveNext = fn } })
  Object.defineProperty(pending, 'reject', { configurable: true, get: () => reject, set: (fn: (err: unknown) => void) => { rejectNext = fn } })
  transaction.unanswered.add(pending)
}

/**
 * A query's answer, by its command tag (postgres.js's Result `command`, from CommandComplete):
 * COMMIT and PREPARE TRANSACTION end the transaction (COMMIT AND CHAIN too, whose new transaction
 * is not the driver's), and the probe tells where that left the connection; ROLLBACK may be
 * ROLLBACK TO SAVEPOINT, which ends nothing, so the probe tells that too; BEGIN starts someone
 * else's (an ORM's transaction()), inside the driver's, which it leaves intact.
 */
function afterAnswer (value: unknown, transaction: Guarded): Promise<void> | undefined {
  const tag = (value as { command?: unknown } | null | undefined)?.command
  if (typeof tag !== 'string') return undefined
  if (ENDING_TAGS.has(tag)) {
    transaction.ended ??= endedBy(tag)
    return transaction.probe()
  }
  if (tag === ROLLBACK_TAG) return transaction.probe()
  if (STARTING_TAGS.has(tag)) transaction.foreign = true
  return undefined
}

/**
 * TRANSACTION_PROBE on the transaction's own handle (the root one, whatever savepoint the handler
 * is in), written at once: called from within the answer of the statement before it, it goes in
 * line behind that statement before postgres.js decides, at the end of the same ReadyForQuery,
 * whether the connection goes back to its pool (client.ts, Ended).
 *
 * - `handler(query)` rather than `execute()`: a query is sent a tick after `execute()`, too late.
 *   `executed` keeps postgres.js from sending it a second time when it is awaited.
 * - Never through the query's `catch`: postgres.js's transaction passes every query it sends
 *   through `catch` to remember the first failure (src/index.js, `scope`'s handler), and throws
 *   that failure when the callback returns, rolling everything back; the probe fails (25P02) in a
 *   failed transaction that a ROLLBACK TO SAVEPOINT may still recover, and must not doom it.
 * - When the statement before left postgres.js unable to write more at once (a cursor, a statement
 *   described before its first execution), postgres.js keeps the probe in the transaction's own
 *   line, which it works through only while the connection stays the transaction's. A probe still
 *   unwritten once that ReadyForQuery was handled means the connection went back to the pool.
 */
function probe (tx: TransactionSql<any>, transaction: Guarded): Promise<void> {
  if (transaction.connection.lost !== null) return Promise.resolve()
  // The simple protocol (no parameters): see TRANSACTION_PROBE.
  const query = tx.unsafe(TRANSACTION_PROBE).values() as unknown as PendingQuery
  Object.defineProperty(query, 'catch', { value: () => query })
  query.executed = true
  transaction.unanswered.add(query)
  query.handler(query)
  const answered = Promise.prototype.then.call(query, (rows: unknown) => {
    const [ours, first] = (rows as unknown[][] | undefined)?.[0] ?? []
    if (ours === true) return
    transaction.ended ??= endedBy('the transaction is no longer the one the claim was made in')
    // Idle: postgres.js hands the connection back to its pool at this probe's ReadyForQuery.
    if (first === true) transaction.released = true
  }, (err: unknown) => {
    if (isConnectionError(err)) return transaction.connection.lose(err)
    if ((err as { code?: unknown } | null)?.code === IN_FAILED_TRANSACTION) return
    // Any other answer leaves it unknown: taken as ended, so the key is held rather than released,
    // and as gone, so nothing more is sent on a connection that may be another's (at worst, one
    // that is still the transaction's stays in it, until the server's idle timeout ends it).
    transaction.ended ??= endedBy('the transaction could not be probed', err)
    transaction.released = true
  }) as Promise<void>
  return new Promise((resolve) => {
    queueMicrotask(() => {
      if (query.state !== null && query.state !== undefined) return resolve(answered.finally(() => { transaction.unanswered.delete(query) }))
      transaction.unanswered.delete(query)
      transaction.ended ??= endedBy('the session is idle: no transaction is open')
      transaction.released = true
      resolve()
    })
  })
}

/**
 * `sql.file()` reads the file first and then sends the query itself, past its own `handler`: read
 * here instead, then put in line and sent through the transaction's handler, which a tagged query
 * made on the same handle carries (that one is never sent).
 */
function fencedFile (handle: TransactionSql<any>, query: PendingQuery, path: string, transaction: Guarded): PendingQuery {
  const send = (handle as unknown as (strings: TemplateStringsArray) => PendingQuery)(Object.assign([''], { raw: [''] }) as unknown as TemplateStringsArray).handler
  const read = (pending: PendingQuery): void => {
    const refused = refusal(transaction)
    if (refused !== null) return pending.reject(refused)
    readFile(path, 'utf8', (err, text) => {
      if (err !== null) return pending.reject(err)
      pending.strings = [text]
      line(pending, send, transaction)
    })
  }
  query.handler = Object.assign(read, { debug: send.debug })
  return query
}
