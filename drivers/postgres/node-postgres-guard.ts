import {
  endedBy, ENDING_TAGS, IN_FAILED_TRANSACTION, refusals, ROLLBACK_TAG, STARTING_TAGS, TRANSACTION_PROBE, type Ended, type Guard
} from './client.js'
import type { ConnectionState } from './dropped-connection.js'

/**
 * The PoolClient given to the application in atomic mode (`request.idempotency.sql`) and to a
 * transactional step. It is the transaction's client, so the handler's queries (its own, or an
 * ORM's on top of it) commit or roll back with the recorded response. What it refuses:
 *
 * - every query once the driver ended the handle's part (`end()`): by then the client is about to
 *   go back to the pool, and a handler still writing (its client went away, an answer was sent on
 *   a timeout) would write outside any transaction, or inside another request's;
 * - every query once the connection was lost (node-postgres would fail them anyway; refusing them
 *   with the same code as postgres.js gives a handler one thing to check for);
 * - every query once the transaction ended under the handle (COMMIT, ROLLBACK, PREPARE
 *   TRANSACTION, AND CHAIN), or after a BEGIN went through it: inside a transaction PostgreSQL
 *   answers BEGIN with a warning only, so an ORM's own `transaction()` on this client (Drizzle's,
 *   Kysely's: BEGIN, the writes, COMMIT) would otherwise COMMIT the claim and the handler's writes
 *   before the response is recorded (test/postgres/orm-recipes.test.ts). Savepoints stay allowed;
 * - `release()`: the store returns the client to the pool when the transaction ends, and a client
 *   released twice is an error in node-postgres.
 *
 * How it knows (client.ts, Guard): every text and config query is built here as the client's own
 * Query with `queryMode: 'extended'` (pg 8.12 and later), and pg-cursor and pg-query-stream always
 * use the extended protocol, so a text of several statements is refused by the server. The guard
 * listens to the client's connection: each CommandComplete's tag and each ReadyForQuery's
 * transaction status, ahead of the client's own listeners (prependListener), so the state is
 * known before node-postgres calls back or sends its next query. Handle queries are handed to the
 * client one at a time, each only once the one before was answered and checked (with the probe,
 * where the tag and status leave a doubt), and each one's `submit` checks again at the moment
 * node-postgres sends it: a query never goes out after the statement that ended the transaction,
 * in pipeline mode either (where node-postgres submits as soon as it is given a query).
 *
 * Every other property is the client's own.
 */
export function guardPoolClient (
  /** A node-postgres PoolClient (node-postgres.ts, NodePostgresPoolClient): only its query method and its wire are used here. */
  client: { query: unknown },
  connection: ConnectionState,
  isConnectionError: (err: unknown) => boolean,
  probeConfig: (text: string) => object
): { readonly handle: object, end: Guard['end'] } {
  const wire = (client as { connection?: Partial<Wire> }).connection
  const QueryClass = (client.constructor as { Query?: QueryConstructor }).Query
  // pg-native has no protocol events to read: nothing can be checked, so nothing is sent.
  const observable = typeof wire?.prependListener === 'function' && typeof wire.removeListener === 'function' && typeof QueryClass === 'function'

  let closed = false
  let ended: Error | null = null
  let foreign = false
  /** Since the last ReadyForQuery: a ROLLBACK tag or an error, after which status 'T' needs the probe. */
  let doubt = false
  let probeDue = false
  /** Queries given to the handle and not yet handed to the client, in order. */
  const waiting: Entry[] = []
  /** The query handed to the client and not yet answered (a handle query, or the probe). */
  let active: Entry | null = null
  let finished = false
  let finish!: (ended: Ended | null) => void
  // The client stays checked out until the driver releases it: the connection is never taken back.
  const drained = new Promise<Ended | null>((resolve) => { finish = resolve })

  function refusal (): Error | null {
    if (closed) return refusals.ended()
    if (ended !== null) return refusals.endedEarly(ended)
    if (connection.lost !== null) return refusals.lost(connection.lost)
    if (!observable) return unobservable()
    return foreign ? refusals.transactionControl() : null
  }

  const end = (how: string, cause?: unknown): void => { ended ??= endedBy(how, cause) }

  const onCommandComplete = (message: { text?: unknown }): void => {
    const tag = typeof message.text === 'string' ? message.text : ''
    if (ENDING_TAGS.has(tag)) end(tag)
    else if (STARTING_TAGS.has(tag)) foreign = true
    else if (tag === ROLLBACK_TAG) doubt = true
  }
  const onErrorMessage = (): void => { doubt = true }
  const onReadyForQuery = (message: { status?: unknown }): void => {
    // Idle, whatever got it there (ROLLBACK, a failed COMMIT or PREPARE TRANSACTION): ended.
    if (message.status === 'I') end('the session is idle: no transaction is open')
    // Still in a transaction block after a ROLLBACK tag or an error: ROLLBACK TO SAVEPOINT, or a
    // new transaction (AND CHAIN)? In a failed block ('E') it is the driver's, aborted.
    if (message.status === 'T' && doubt && active?.kind !== 'probe') probeDue = true
    doubt = false
    const entry = active
    if (entry === null || !entry.submitted) return
    entry.answered = true
    if (entry.kind === 'probe') {
      if (entry.verdict !== undefined) settle(entry)
      return
    }
    settle(entry)
  }

  /** The entry's cycle is over: hand the next query to the client (or the probe first). */
  function settle (entry: Entry): void {
    if (active !== entry) return
    active = null
    advance()
  }

  function advance (): void {
    if (active !== null || finished) return
    if (probeDue && ended === null && connection.lost === null && observable) {
      probeDue = false
      return sendProbe()
    }
    probeDue = false
    for (let entry = waiting.shift(); entry !== undefined; entry = waiting.shift()) {
      const refused = refusal()
      if (refused !== null) {
        refuseEntry(entry, refused)
        continue
      }
      active = entry
      ;(client.query as (query: unknown) => unknown).call(client, entry.query)
      return
    }
    if (closed) done()
  }

  function sendProbe (): void {
    const probe = new (QueryClass as QueryConstructor)(probeConfig(TRANSACTION_PROBE)) as unknown as Submittable
    const entry: Entry = { kind: 'probe', query: probe, submitted: false, answered: false }
    probe.callback = (err, result) => {
      if (err !== null && err !== undefined) {
        if (isConnectionError(err)) connection.lose(err)
        else if ((err as { code?: unknown }).code !== IN_FAILED_TRANSACTION) end('the transaction could not be probed', err)
      } else if ((result as { rows?: unknown[][] } | undefined)?.rows?.[0]?.[0] !== true) {
        end('the transaction is no longer the one the claim was made in')
      }
      entry.verdict = true
      if (entry.answered || !entry.submitted) settle(entry)
    }
    gate(entry)
    active = entry
    ;(client.query as (query: unknown) => unknown).call(client, probe)
  }

  /**
   * The last check, when node-postgres sends the query (after the ReadyForQuery of the one
   * before, in pipeline mode at once): a refused query is failed by node-postgres with the Error
   * its `submit` returns, before anything was written (lib/client.js, `_pulseQueryQueue`). A query
   * that was not sent (refused, or the client is ending, or failed) gets `handleError` without a
   * ReadyForQuery to follow, and its turn ends there.
   */
  function gate (entry: Entry): void {
    const query = entry.query
    const submit = query.submit
    query.submit = function (this: Submittable, ...args: unknown[]) {
      const refused = entry.kind === 'probe' ? null : refusal()
      if (refused !== null) return refused
      entry.submitted = true
      const result = submit.apply(this, args)
      // Its own refusal (values that are not an array, say): nothing was sent.
      if (result instanceof Error) entry.submitted = false
      return result
    }
    const handleError = query.handleError
    if (typeof handleError === 'function') {
      query.handleError = function (this: Submittable, ...args: unknown[]) {
        if (!entry.submitted) settle(entry)
        return handleError.apply(this, args)
      }
    }
  }

  function done (): void {
    if (finished) return
    finished = true
    if (observable) {
      const events = wire as Wire
      events.removeListener('commandComplete', onCommandComplete)
      events.removeListener('errorMessage', onErrorMessage)
      events.removeListener('readyForQuery', onReadyForQuery)
    }
    finish(ended === null ? null : { reason: ended, released: false })
  }

  if (observable) {
    const events = wire as Wire
    events.prependListener('commandComplete', onCommandComplete)
    events.prependListener('errorMessage', onErrorMessage)
    events.prependListener('readyForQuery', onReadyForQuery)
  }
  connection.onLost((err) => {
    for (const entry of waiting.splice(0)) refuseEntry(entry, refusals.lost(err))
    // node-postgres fails the query in flight itself.
    active = null
    done()
  })

  const query = (...args: unknown[]): unknown => {
    const first = args[0]
    // What node-postgres throws itself for these, synchronously.
    if (first === null || first === undefined) return (client.query as (...a: unknown[]) => unknown).apply(client, args)
    const refused = refusal()
    if (refused !== null) return refuse(refused, args)
    const built = build(args)
    if (built instanceof Error) return refuse(built, args)
    const entry: Entry = { kind: 'handle', query: built.query, submitted: false, answered: false }
    gate(entry)
    waiting.push(entry)
    advance()
    return built.result
  }

  /**
   * The query as the client would build it, as its own Query class, with the extended protocol
   * forced; a submittable (pg-cursor, pg-query-stream, a Query) as it is. A callback is wrapped to
   * note a connection error before the caller sees it.
   */
  function build (args: unknown[]): { query: Submittable, result: unknown } | Error {
    const [config, values, callback] = args
    const wrap = (fn: Callback): Callback => (err, result) => {
      if (isConnectionError(err)) connection.lose(err)
      fn(err, result)
    }
    if (typeof (config as Partial<Submittable>).submit === 'function') {
      const query = config as Submittable
      const cb = typeof values === 'function' ? values : callback
      if (typeof query.callback !== 'function' && typeof cb === 'function') query.callback = wrap(cb as Callback)
      return extended(query) ?? { query, result: query }
    }
    const query = new (QueryClass as QueryConstructor)(config, typeof values === 'function' ? undefined : values) as unknown as Submittable
    const timeout = (config as { query_timeout?: unknown }).query_timeout
    if (timeout !== undefined) query.query_timeout = timeout
    const refused = extended(query)
    if (refused !== undefined) return refused
    const cb = typeof values === 'function' ? values : typeof callback === 'function' ? callback : query.callback
    if (typeof cb === 'function') {
      query.callback = wrap(cb as Callback)
      return { query, result: undefined }
    }
    const result = new Promise((resolve, reject) => {
      query.callback = wrap((err, rows) => { if (err !== null && err !== undefined) reject(err); else resolve(rows) })
    })
    return { query, result }
  }

  const release = (): never => {
    throw new Error("fastify-idempotency: request.idempotency.sql is the request's transaction; the store releases it when the transaction ends")
  }

  const handle = new Proxy(client as object, {
    get (target, property) {
      if (property === 'query') return query
      if (property === 'release') return release
      const value: unknown = Reflect.get(target, property, target)
      return typeof value === 'function' ? (value as (...a: unknown[]) => unknown).bind(target) : value
    }
  })
  return {
    handle,
    end () {
      if (!closed) {
        closed = true
        for (const entry of waiting.splice(0)) refuseEntry(entry, refusals.ended())
        advance()
      }
      return drained
    }
  }
}

/** The parts of node-postgres's Connection (lib/connection.js) the guard listens to. */
interface Wire {
  prependListener (event: string, listener: (message: never) => void): unknown
  removeListener (event: string, listener: (message: never) => void): unknown
}

type Callback = (err: unknown, result?: unknown) => void

/** node-postgres's Query (lib/query.js), and what the client takes as a submittable. */
type QueryConstructor = new (config: unknown, values?: unknown) => object
interface Submittable {
  submit (...args: unknown[]): unknown
  handleError?: (...args: unknown[]) => unknown
  callback?: Callback
  /** pg's Query: true when it will be sent with the extended protocol. */
  requiresPreparation?: () => boolean
  queryMode?: string
  query_timeout?: unknown
}

interface Entry {
  readonly kind: 'handle' | 'probe'
  readonly query: Submittable
  /** Its `submit` ran: what the connection reports from now on is its answer. */
  submitted: boolean
  /** Its ReadyForQuery came. */
  answered: boolean
  /** The probe's callback ran. */
  verdict?: true
}

/**
 * A Query sent with the extended protocol (pg 8.12 added `queryMode`); an older pg would send a
 * text without parameters with the simple protocol, where one text may carry several statements:
 * refused then, with why.
 */
function extended (query: Submittable): Error | undefined {
  if (typeof query.requiresPreparation !== 'function') return undefined
  query.queryMode = 'extended'
  if (query.requiresPreparation()) return undefined
  return new Error("fastify-idempotency: request.idempotency.sql sends every query with the extended query protocol (the pg Query option queryMode: 'extended'), which this version of pg ignores; upgrade pg to 8.12 or later")
}

const unobservable = (): Error => new Error("fastify-idempotency: request.idempotency.sql needs node-postgres's JavaScript client (its connection reports each statement's outcome); this client reports none (pg-native), so nothing is sent through it")

/** A handle query refused after it was given to the handle: failed as node-postgres fails one, on the next tick. */
function refuseEntry (entry: Entry, error: Error): void {
  const query = entry.query
  process.nextTick(() => {
    if (typeof query.handleError === 'function') query.handleError(error)
    else query.callback?.(error)
  })
}

/** A refused query fails the way the caller is listening: its callback, a submittable's handler, or a rejected promise. */
function refuse (error: Error, args: unknown[]): unknown {
  const last = args[args.length - 1]
  if (typeof last === 'function') {
    process.nextTick(() => { (last as (err: Error) => void)(error) })
    return undefined
  }
  const submittable = args[0] as { submit?: unknown, handleError?: unknown } | null
  if (typeof submittable?.submit === 'function') {
    if (typeof submittable.handleError === 'function') {
      process.nextTick(() => { (submittable.handleError as (err: Error) => void).call(submittable, error) })
    }
    return submittable
  }
  return Promise.reject(error)
}
