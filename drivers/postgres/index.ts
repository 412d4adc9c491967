/**
 * The PostgreSQL driver: `import { postgresStore, migrate } from 'fastify-idempotency/postgres'`.
 * It runs on either client, both optional peer dependencies and never imported here: postgres.js
 * (`postgresStore({ sql })`) or node-postgres (`postgresStore({ pool })`, also `fastify.pg.pool`).
 */
import type { TransactionSql } from 'postgres'
// The plugin's types for Fastify (`request.idempotency`, `config.idempotency`): a file that imports
// only this entry point sees them too.
import '../../lib/fastify/types.js'

export { postgresStore, type PostgresStore } from './store.js'
export { migrate } from './schema.js'
export type {
  BackgroundTask, NodePostgresPoolLike, PostgresClient, PostgresStoreOptions, TableOptions
} from './options.js'
export type { DeliveryReport, OutboxMessage, OutboxOptions } from './outbox.js'

/**
 * Picks the type of `request.idempotency.sql` (and of a transactional step's argument). Empty, it
 * is postgres.js's `TransactionSql`; an application on node-postgres declares its client once:
 *
 * ```ts
 * import type { PoolClient } from 'pg'
 * declare module 'fastify-idempotency/postgres' {
 *   interface AtomicTransactionTypes { client: PoolClient }
 * }
 * ```
 *
 * (A declaration, because the type of a request's property cannot follow the store a plugin was
 * registered with; and the driver's own types name nothing of `pg`, so they load without @types/pg.)
 */

export interface AtomicTransactionTypes {}

/** The handle of a request's transaction: see {@link AtomicTransactionTypes}. */
export type AtomicTransaction = AtomicTransactionTypes extends { client: infer Client } ? Client : TransactionSql<any>

declare module '../../lib/core/context.js' {
  interface IdempotencyContext {
    /**
     * Atomic mode (`transaction: true`): the transaction that holds this request's claim, on the
     * client the store runs on (a postgres.js `TransactionSql`, or a node-postgres `PoolClient`
     * inside BEGIN; see AtomicTransactionTypes). Write the operation's effects through it; they
     * commit together with the recorded response, or roll back with the claim. Refuses queries once
     * the transaction ended. Undefined in lease mode.
     */
    readonly sql?: AtomicTransaction

    /**
     * A transactional recovery point (lease mode): `fn` runs in a new transaction that also records
     * the step, so its writes and its record commit together, or neither does (then the step runs
     * again on the next attempt). Enqueue outbox messages through the handle it receives.
     */
    step<T> (name: string, fn: (sql: AtomicTransaction) => T | Promise<T>, options: { readonly transaction: true }): Promise<T>
  }
}
