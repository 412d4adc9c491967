/**
 * The PostgreSQL driver: `import { postgresStore, migrate } from 'fastify-idempotency/postgres'`.
 * `postgres` (porsager) is an optional peer dependency, imported only through this entry point.
 */
import type { TransactionSql } from 'postgres'

export { postgresStore, type PostgresStore } from './store.js'
export { migrate } from './schema.js'
export type { PostgresClient, PostgresStoreOptions, TableOptions } from './options.js'
export type { DeliveryReport, OutboxMessage, OutboxOptions } from './outbox.js'

declare module '../../lib/context.js' {
  interface IdempotencyContext {
    /**
     * Atomic mode (`transaction: true`): the transaction that holds this request's claim. Write the
     * operation's effects through it; they commit together with the recorded response, or roll back
     * with the claim. Refuses queries once the transaction ended. Undefined in lease mode.
     */
    readonly sql?: TransactionSql<any>

    /**
     * A transactional recovery point (lease mode): `fn` runs in a new transaction that also records
     * the step, so its writes and its record commit together, or neither does (then the step runs
     * again on the next attempt). Enqueue outbox messages through the `sql` it receives.
     */
    step<T> (name: string, fn: (sql: TransactionSql<any>) => T | Promise<T>, options: { readonly transaction: true }): Promise<T>
  }
}
