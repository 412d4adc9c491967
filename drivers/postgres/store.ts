import { randomUUID } from 'node:crypto'
import type { RecoveryTools } from '../../lib/core/admin.js'
import { fingerprintsEqual } from '../../lib/core/fingerprint.js'
import { reconcileWith, startReconcilerWith, type ReconcileOptions, type ReconcilerOptions, type ReconcileReport } from '../../lib/core/reconcile.js'
import type {
  ClaimRequest, ClaimResult, IdempotencyStore, InTransactionClaimRequest, Lease, OutboxEntry, RecordId, SettlementHandlers, StepResults, StoredRecord, StoredResponse
} from '../../lib/core/store.js'
import { integerOption } from '../../lib/core/validate.js'
import { resolveStoreOptions, type BackgroundTask, type PostgresStoreOptions } from './options.js'
import { createOutbox, type DeliveryReport } from './outbox.js'
import { createRecovery } from './recovery.js'
import { migrateOn } from './schema.js'
import { checkSchema } from './schema-check.js'
import { announceSettlement, settlementChannel, watchChannel } from './settlements.js'
import { answerFrom, createStatements } from './statements.js'
import { createTransactions } from './transaction.js'

/** An {@link IdempotencyStore} on PostgreSQL that can also create its own table. */
export interface PostgresStore extends IdempotencyStore, RecoveryTools {
  /** Creates the schema, table and index when missing (see {@link migrate}); safe to call at every boot. */
  migrate (): Promise<void>
  /**
   * Rejects with `StoreNotReadyError` when the tables are missing or lack columns this version uses
   * (run `migrate()`); one catalog read. The plugin calls it when the app boots.
   */
  check (): Promise<void>
  /** Atomic mode (route option `transaction: true`); see transaction.ts. */
  claimInTransaction (request: InTransactionClaimRequest): Promise<ClaimResult>
  /** Transactions held open by atomic-mode requests in flight; 0 when idle means no connection leaked. */
  readonly openTransactions: number
  loadSteps (lease: Lease): Promise<StepResults | null>
  saveStep (lease: Lease, name: string, resultJson: string): Promise<boolean>
  runStepInTransaction (lease: Lease, name: string, fn: (transaction: unknown) => Promise<unknown>, toJson: (value: unknown) => string): Promise<string | null>
  hold (lease: Lease): Promise<boolean>
  enqueue (transaction: unknown, message: RecordId & OutboxEntry): Promise<void>
  afterCommit (id: RecordId): void
  /**
   * Delivers up to `limit` due outbox messages (left by a crash, or waiting for a retry after a
   * failed delivery). `startReconciler` does this on every pass; call it yourself without one.
   */
  deliverOutbox (limit?: number): Promise<DeliveryReport>
}

/** Other instances' reconcilers wait for this lock; the table's name is part of it, so two tables reconcile independently. */
const RECONCILER_LOCK = 'fastify-idempotency:reconcile:'

/**
 * How many rounds one claim may take (see claimRound). Each extra round means another attempt
 * changed the record meanwhile, or a serialization failure; a handful is already pathological churn.
 */
const MAX_CLAIM_ROUNDS = 10

/**
 * SQLSTATEs after which a statement is simply run again: a serialization failure (40001), raised
 * instead of a READ COMMITTED re-check when the database or role defaults to REPEATABLE READ or
 * SERIALIZABLE, and a deadlock (40P01), possible between two purge batches. Neither changed
 * anything, and every statement here is safe to repeat.
 */
const RETRYABLE = new Set(['40001', '40P01'])
const MAX_STATEMENT_ATTEMPTS = 3

/** A lease token is a UUID; anything else cannot own a record (and would fail the uuid cast). */
const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i

/**
 * The shared source of truth for several app instances: PostgreSQL's primary key on (scope, key)
 * decides who executes (lease mode: one short statement per decision, no transaction held while
 * the handler runs). Leases and expiry are measured on the database clock.
 *
 * The `sql` client stays the caller's: the store never ends it. Run {@link migrate} (or
 * `store.migrate()`) once before use, or apply `schema.sql` with your migration tool.
 *
 * @example
 * import postgres from 'postgres'
 * import idempotency from 'fastify-idempotency'
 * import { postgresStore } from 'fastify-idempotency/postgres'
 *
 * const sql = postgres(process.env.DATABASE_URL)
 * const store = postgresStore({ sql })
 * await store.migrate()
 * await app.register(idempotency, { store, scope: (request) => request.accountId }) // set by your authentication hook
 * // store.close() first (it waits for a background purge in flight), then your client. A timeout,
 * // because postgres.js 3.4.9's end() never resolves after a connection died mid-query
 * // (porsager/postgres#1097).
 * app.addHook('onClose', async () => { await store.close(); await sql.end({ timeout: 5 }) })
 */
export function postgresStore (options: PostgresStoreOptions): PostgresStore {
  const settings = resolveStoreOptions(options)
  const db = settings.db
  const table = `${db.identifier(settings.schema)}.${db.identifier(settings.table)}`
  const statements = createStatements(db, table)
  const transactions = createTransactions(db, table)
  const recovery = createRecovery(db, table)
  const outbox = settings.outbox === null ? null : createOutbox(db, `${db.identifier(settings.schema)}.${db.identifier(`${settings.table}_outbox`)}`, settings.outbox)
  const deliveries = new Set<Promise<unknown>>()
  const channel = settlementChannel(settings.schema, settings.table)
  /** Leases claimed with `announce`: their settlement is noticed (settlements.ts). Weak: a lease never settled goes with it. */
  const announced = new WeakSet<Lease>()
  const notices = new Set<Promise<unknown>>()
  const watches = new Set<() => void>()
  let purging: Promise<void> | null = null
  let closed = false

  const timer = settings.purgeInterval > 0 ? setInterval(purgeInBackground, settings.purgeInterval) : null
  timer?.unref()
  // node-postgres emits an idle client's connection error on the pool; without a listener that
  // throws and ends the process (options.ts, `pool`). Not added when the application listens.
  if (settings.pool !== null && settings.pool.listenerCount('error') === 0) {
    settings.pool.on('error', (err) => { reportBackground(err, 'connection') })
  }

  /** One background purge at a time; an error goes to onBackgroundError, and the next tick retries. */
  function purgeInBackground (): void {
    if (purging !== null || closed) return
    purging = purge(Infinity).then(() => {}, (err: unknown) => { reportBackground(err, 'purge') }).finally(() => { purging = null })
  }

  function reportBackground (err: unknown, task: BackgroundTask): void {
    try {
      settings.onBackgroundError?.(err, task)
    } catch {
      // A throwing reporter must not become an unhandled rejection in a timer.
    }
  }

  /**
   * Up to `limit` records, in statements of at most `purgeBatch` each, until one deletes nothing.
   * Not "until a batch comes back short": a batch also comes back short when a
   * record it picked was reclaimed meanwhile, while more expired records remain.
   */
  async function purge (limit: number): Promise<number> {
    let total = 0
    while (total < limit && !closed) {
      const batch = Math.min(settings.purgeBatch, limit - total)
      const deleted = await retrying(() => statements.purge(batch))
      if (deleted === 0) break
      total += deleted
    }
    while (outbox !== null && !closed) {
      if (await retrying(() => outbox.purgeDelivered(settings.purgeBatch)) === 0) break
    }
    return total
  }

  /** Not awaited by the settlement it follows; close() waits for it. A failure delays waiters, never an answer. */
  function announce (id: RecordId): void {
    if (closed) return
    const notice = announceSettlement(db, channel, id).catch((err: unknown) => { reportBackground(err, 'notify') }).finally(() => { notices.delete(notice) })
    notices.add(notice)
  }

  /** `settled`: whether the settlement took effect; noticed when it did and `always` or the lease was announced. */
  function noticed (lease: Lease, settled: boolean, always = false): boolean {
    if (settled && (always || announced.has(lease))) announce(lease)
    return settled
  }

  function requireOutbox (): NonNullable<typeof outbox> {
    if (outbox === null) throw new TypeError('fastify-idempotency: this postgres store has no outbox: postgresStore({ sql, outbox: { deliver } })')
    return outbox
  }

  // The reconciler's resolutions are noticed whatever the claim asked: they are rare, and a
  // duplicate may be waiting on a held record.
  const recoverySource = recovery.source(
    async (lease, response, ttlMs) => noticed(lease, await retrying(() => statements.complete(lease, response, ttlMs)), true),
    async (lease) => noticed(lease, await retrying(() => statements.release(lease)), true)
  )
  const reconcileSource = {
    ...recoverySource,
    resume: async (lease: Lease, ttlMs: number) => noticed(lease, await recoverySource.resume(lease, ttlMs), true)
  }

  /**
   * A reconciler pass, then the outbox's leftovers, under a transaction-level advisory lock: the
   * lock ends with the transaction however the pass ends (a dead connection included), and nothing
   * else runs in that transaction, so it holds no row lock and no snapshot. Not postgres.js's
   * `sql.reserve()`: in 3.4.9 it never resolves on a fresh connection of a client created with
   * `fetch_types: false` (porsager/postgres#751), the setting the README recommends. The pass's
   * own statements use other connections of the pool, hence at least two.
   */
  async function exclusively (run: () => Promise<void>): Promise<boolean> {
    const lock = `${RECONCILER_LOCK}${settings.schema}.${settings.table}`
    let ran = false
    // The lock's connection may drop while the pass runs: then no COMMIT (or ROLLBACK) is sent on
    // it, and this rejects with the connection's error (dropped-connection.ts).
    await db.transaction(async (tx) => {
      const { rows } = await tx.query('SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))', [lock])
      if (rows[0]?.[0] !== true) return
      ran = true
      await run()
    })
    return ran
  }

  /**
   * One look at the record and at most one conditional write. Null when the record changed under
   * it (a row committed after the statement's snapshot, a reclaim or takeover won by another
   * attempt, or the owner renewed or completed meanwhile): the caller looks again.
   */
  async function claimRound (request: ClaimRequest): Promise<ClaimResult | null> {
    const args = { ...request, token: randomUUID() }
    const result = await statements.claim(args)
    if (result === null) return null
    if (result.acquired) return acquired(request, args.token, false)
    const record = result.record
    if (record.expired) {
      return await statements.reclaim(args, record.token) ? acquired(request, args.token, false) : null
    }
    if (record.state === 'in_progress' && record.lapsed && fingerprintsEqual(record.fingerprint, request.fingerprint)) {
      return await statements.takeover(args, record.token) ? acquired(request, args.token, true) : null
    }
    return answerFrom(record)
  }

  function acquired (request: ClaimRequest, token: string, takeover: boolean): ClaimResult {
    const lease = { scope: request.scope, key: request.key, token }
    if (request.announce === true) announced.add(lease)
    return { outcome: 'acquired', lease, takeover }
  }

  return {
    async claim (request: ClaimRequest): Promise<ClaimResult> {
      let failure: unknown = null
      for (let round = 0; round < MAX_CLAIM_ROUNDS; round++) {
        try {
          const result = await claimRound(request)
          if (result !== null) return result
        } catch (err) {
          if (!retryable(err)) throw err
          failure = err
        }
      }
      if (failure !== null) throw failure
      throw new Error(`fastify-idempotency: the postgres store could not settle a claim in ${MAX_CLAIM_ROUNDS} rounds; the record kept changing under it`)
    },

    async claimInTransaction (request) {
      const result = await transactions.claimInTransaction(request)
      if (result.outcome === 'acquired' && request.announce === true) announced.add(result.lease)
      return result
    },

    get openTransactions () { return transactions.size },

    async complete (lease: Lease, response: StoredResponse, ttlMs: number): Promise<boolean> {
      if (transactions.owns(lease.token)) return noticed(lease, await transactions.commit(lease, response, ttlMs))
      return UUID.test(lease.token) && noticed(lease, await retrying(() => statements.complete(lease, response, ttlMs)))
    },

    async release (lease: Lease): Promise<boolean> {
      if (transactions.owns(lease.token)) return noticed(lease, await transactions.rollback(lease))
      return UUID.test(lease.token) && noticed(lease, await retrying(() => statements.release(lease)))
    },

    // An open transaction holds its record (a crash rolls it back): there is no lease to extend.
    async renew (lease: Lease, leaseMs: number): Promise<boolean> {
      if (transactions.owns(lease.token)) return true
      return UUID.test(lease.token) && retrying(() => statements.renew(lease, leaseMs))
    },

    async get (id: RecordId): Promise<StoredRecord | null> {
      const record = await retrying(() => statements.get(id))
      if (record === null) return null
      return record.state === 'completed' && record.response !== null
        ? { state: 'completed', fingerprint: record.fingerprint, response: record.response }
        : { state: 'in_progress', fingerprint: record.fingerprint, leaseRemainingMs: record.leaseRemainingMs }
    },

    async purgeExpired (limit: number = settings.purgeBatch): Promise<number> {
      if (limit !== Infinity && (!Number.isInteger(limit) || limit < 0)) {
        throw new TypeError(`fastify-idempotency: purgeExpired(limit) takes a non-negative integer or Infinity; received ${String(limit)}`)
      }
      return purge(limit)
    },

    loadSteps: (lease) => retrying(() => recovery.loadSteps(lease)),
    saveStep: (lease, name, resultJson) => retrying(() => recovery.saveStep(lease, name, resultJson)),
    runStepInTransaction: recovery.runStepInTransaction,
    hold: async (lease) => noticed(lease, await retrying(() => recovery.hold(lease))),
    inspect: (id) => retrying(() => recovery.inspect(id)),
    listHeld: async (limit) => {
      const most = integerOption('postgresStore.listHeld(limit)', limit, 100, 1, 100_000)
      return await retrying(() => recovery.listHeld(most))
    },
    forceRelease: async (id) => {
      const released = await retrying(() => recovery.forceRelease(id))
      if (released) announce(id)
      return released
    },

    watchSettlements (handlers: SettlementHandlers): () => void {
      const stop = watchChannel(db, channel, handlers, (err) => { reportBackground(err, 'listener') })
      watches.add(stop)
      return () => {
        watches.delete(stop)
        stop()
      }
    },

    reconcile: (options: ReconcileOptions): Promise<ReconcileReport> => reconcileWith(reconcileSource, options, 'postgresStore.reconcile'),

    startReconciler (options: ReconcilerOptions) {
      const max = db.maxConnections
      if (max !== undefined && max < 2) {
        throw new TypeError(`fastify-idempotency: startReconciler needs a ${db.library === 'pg' ? 'node-postgres pool' : 'postgres client'} with at least 2 connections (max: ${max}): one holds the lock while the pass runs on another`)
      }
      return startReconcilerWith(reconcileSource, options, 'postgresStore.startReconciler', {
        exclusive: exclusively,
        afterPass: outbox === null ? undefined : async (limit) => await outbox.deliverDue(limit)
      })
    },

    enqueue: async (transaction, message) => await requireOutbox().enqueue(transaction, message),

    afterCommit (id: RecordId): void {
      if (outbox === null || closed) return
      // Not awaited by the request; close() waits for it. A failure leaves the message due for the worker.
      const delivery = outbox.deliverFor(id).catch((err: unknown) => { reportBackground(err, 'outbox') }).finally(() => { deliveries.delete(delivery) })
      deliveries.add(delivery)
    },

    deliverOutbox: async (limit = 100) => await requireOutbox().deliverDue(limit),

    async migrate (): Promise<void> {
      await migrateOn(db, settings)
    },

    check: async () => { await checkSchema(db, settings, outbox !== null) },

    // Waits for a background purge in flight, so nothing of the store's runs on the client after
    // close() resolves (the caller may end its client right after).
    async close (): Promise<void> {
      closed = true
      if (timer !== null) clearInterval(timer)
      for (const stop of [...watches]) stop()
      watches.clear()
      await purging
      await Promise.all([...deliveries, ...notices])
    }
  }
}

/**
 * Runs a statement again after a serialization failure or deadlock. Other errors (a server
 * error, a closed connection) propagate unchanged: the plugin turns them into a 503. Nothing here
 * logs; neither client puts the bound parameters (keys, bodies) on its errors (postgres.js does
 * with `debug`).
 */
async function retrying<T> (statement: () => Promise<T>): Promise<T> {
  for (let attempt = 1; ; attempt++) {
    try {
      return await statement()
    } catch (err) {
      if (attempt >= MAX_STATEMENT_ATTEMPTS || !retryable(err)) throw err
    }
  }
}

function retryable (err: unknown): boolean {
  const code = (err as { code?: unknown } | null)?.code
  return typeof code === 'string' && RETRYABLE.has(code)
}
