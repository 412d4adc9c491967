import { checkName, deriveKey } from '../../lib/core/derive.js'
import { InvalidOptionError } from '../../lib/core/errors.js'
import type { OutboxEntry, RecordId } from '../../lib/core/store.js'
import { integerOption, MAX_TIMER_MS } from '../../lib/core/validate.js'
import type { DatabaseClient, Value } from './client.js'
import { asDate } from './dates.js'

/*
 * The transactional outbox: record the operation first, make the external call carry its own
 * idempotency identifier. A message is inserted by the same transaction as the handler's
 * writes (atomic mode, or a transactional step), so it exists if and only if they committed; it is
 * delivered after the commit, carrying the key derived from (scope, key, name), and marked
 * delivered. A crash between commit and delivery leaves it due: the worker delivers it later. A
 * delivery can therefore happen more than once (a deliverer that died after `deliver` but before
 * marking it); the derived key is what lets the receiver keep it to one effect.
 */

/** A message as `deliver` receives it. */
export interface OutboxMessage extends RecordId, OutboxEntry {
  /** deriveKey(scope, key, name): pass it to the receiver as its idempotency key. */
  readonly deliveryKey: string
  /** Which attempt this is (1 for the first). */
  readonly attempt: number
  readonly createdAt: Date
}

export interface OutboxOptions {
  /** Delivers one message; a throw (or rejection) schedules a retry with backoff. */
  deliver (message: OutboxMessage): void | Promise<void>
  /** First retry delay after a failed delivery, in ms, doubled per attempt up to an hour. @defaultValue 1000 */
  retryDelay?: number
  /**
   * How long a deliverer owns a message before another may try it, in ms; also how long the worker
   * leaves a fresh message to the request that enqueued it. Longer than a delivery takes. @defaultValue 30_000
   */
  visibility?: number
  /** How long delivered messages are kept (for audit), in ms; the store's purge deletes them after. @defaultValue 86_400_000 */
  retention?: number
}

export interface ResolvedOutboxOptions {
  readonly deliver: OutboxOptions['deliver']
  readonly retryDelay: number
  readonly visibility: number
  readonly retention: number
}

export interface DeliveryReport {
  readonly delivered: number
  readonly failed: number
}

export interface Outbox {
  enqueue (transaction: unknown, message: RecordId & OutboxEntry): Promise<void>
  /** Delivers the due messages of one operation (after its transaction committed). */
  deliverFor (id: RecordId): Promise<DeliveryReport>
  /** Delivers up to `limit` due messages of any operation (the worker: leftovers after a crash, retries). */
  deliverDue (limit: number): Promise<DeliveryReport>
  /** Deletes up to `limit` delivered messages older than the retention. */
  purgeDelivered (limit: number): Promise<number>
}

const MAX_RETRY_DELAY_MS = 3_600_000

export function resolveOutboxOptions (options: unknown): ResolvedOutboxOptions | null {
  if (options === undefined) return null
  const outbox = options as OutboxOptions
  if (outbox === null || typeof outbox !== 'object' || typeof outbox.deliver !== 'function') {
    throw new InvalidOptionError('postgresStore option "outbox"', 'an object with a deliver(message) function', options)
  }
  return {
    deliver: outbox.deliver,
    retryDelay: integerOption('postgresStore option "outbox.retryDelay"', outbox.retryDelay, 1000, 1, MAX_RETRY_DELAY_MS, 'ms'),
    visibility: integerOption('postgresStore option "outbox.visibility"', outbox.visibility, 30_000, 1, MAX_TIMER_MS, 'ms'),
    retention: integerOption('postgresStore option "outbox.retention"', outbox.retention, 86_400_000, 0, Number.MAX_SAFE_INTEGER, 'ms')
  }
}

/** createdAt: a Date, or its text if the client's parsers were changed (dates.ts). */
type MessageColumns = [scope: string, key: string, name: string, topic: string, payload: unknown, deliveryKey: string, attempt: number, createdAt: unknown]

/** `table`: the quoted, schema-qualified name of the outbox table. */
export function createOutbox (db: DatabaseClient, table: string, options: ResolvedOutboxOptions): Outbox {
  const ms = (n: number): string => `$${n}::float8 * interval '1 millisecond'`
  const columns = 'scope, key, name, topic, payload, delivery_key, attempts, created_at'

  // Due for the worker only after `visibility`: until then the request that enqueued it delivers it.
  const enqueueText = `
    INSERT INTO ${table} (scope, key, name, topic, payload, delivery_key, next_attempt_at)
    VALUES ($1, $2, $3, $4, $5::text::jsonb, $6, now() + ${ms(7)})
    ON CONFLICT (scope, key, name) DO NOTHING`

  // Claiming a message for delivery pushes its next attempt `visibility` away, so one deliverer at
  // a time has it. The request's own delivery may take a message never attempted before it is due.
  const claimForText = `
    UPDATE ${table} SET attempts = attempts + 1, next_attempt_at = now() + ${ms(3)}
    WHERE scope = $1 AND key = $2 AND delivered_at IS NULL AND (attempts = 0 OR next_attempt_at <= now())
    RETURNING ${columns}`

  // The outer WHERE repeats the subquery's conditions: a message claimed or delivered by another
  // deliverer after the subquery picked it must not be claimed again (see the purge in statements.ts).
  const claimDueText = `
    UPDATE ${table} SET attempts = attempts + 1, next_attempt_at = now() + ${ms(1)}
    WHERE delivered_at IS NULL AND next_attempt_at <= now()
      AND (scope, key, name) IN (
        SELECT scope, key, name FROM ${table} WHERE delivered_at IS NULL AND next_attempt_at <= now()
        ORDER BY next_attempt_at LIMIT $2::int)
    RETURNING ${columns}`

  const deliveredText = `
    UPDATE ${table} SET delivered_at = now(), last_error = NULL
    WHERE scope = $1 AND key = $2 AND name = $3 AND delivered_at IS NULL`

  const failedText = `
    UPDATE ${table} SET next_attempt_at = now() + ${ms(4)}, last_error = $5
    WHERE scope = $1 AND key = $2 AND name = $3 AND delivered_at IS NULL`

  const purgeText = `
    DELETE FROM ${table}
    WHERE delivered_at <= now() - ${ms(1)}
      AND (scope, key, name) IN (SELECT scope, key, name FROM ${table} WHERE delivered_at <= now() - ${ms(1)} LIMIT $2::int)`

  const run = (text: string, values: Value[]): ReturnType<DatabaseClient['query']> => db.query(text, values)

  async function deliverAll (rows: MessageColumns[]): Promise<DeliveryReport> {
    let delivered = 0
    let failed = 0
    const messages = rows.map(([scope, key, name, topic, payload, deliveryKey, attempt, createdAt]): OutboxMessage =>
      ({ scope, key, name, topic, payload, deliveryKey, attempt, createdAt: asDate(createdAt) }))
    messages.sort((a, b) => a.createdAt.getTime() - b.createdAt.getTime())
    for (const message of messages) {
      const { scope, key, name, attempt } = message
      try {
        await options.deliver(message)
      } catch (err) {
        failed++
        const delay = Math.min(options.retryDelay * 2 ** Math.min(attempt - 1, 30), MAX_RETRY_DELAY_MS)
        await run(failedText, [scope, key, name, delay, String((err as Error | null)?.message ?? err).slice(0, 1000)]).catch(() => {})
        continue
      }
      await run(deliveredText, [scope, key, name])
      delivered++
    }
    return { delivered, failed }
  }

  return {
    async enqueue (transaction, message) {
      checkName('enqueue', message?.name)
      if (typeof message.topic !== 'string') throw new TypeError(`fastify-idempotency: an outbox message's topic must be a string; received ${typeof message.topic}`)
      const payload = JSON.stringify(message.payload)
      if (payload === undefined) throw new TypeError('fastify-idempotency: an outbox message\'s payload must be a JSON value')
      const tx = db.connectionOf(transaction)
      if (tx === null) {
        throw new TypeError('fastify-idempotency: enqueue() needs the transaction the message commits with (atomic mode: request.idempotency.sql; lease mode: the one a step(name, fn, { transaction: true }) receives)')
      }
      await tx.query(enqueueText, [
        message.scope, message.key, message.name, message.topic, payload,
        deriveKey(message.scope, message.key, message.name), options.visibility
      ])
    },

    async deliverFor (id) {
      const { rows } = await run(claimForText, [id.scope, id.key, options.visibility])
      return deliverAll(rows as unknown as MessageColumns[])
    },

    async deliverDue (limit) {
      const { rows } = await run(claimDueText, [options.visibility, limit])
      return deliverAll(rows as unknown as MessageColumns[])
    },

    async purgeDelivered (limit) {
      const result = await run(purgeText, [options.retention, limit])
      return result.count
    }
  }
}
