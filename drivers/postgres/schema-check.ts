import { StoreNotReadyError } from '../../lib/core/errors.js'
import type { DatabaseClient } from './client.js'
import type { ResolvedNames } from './options.js'

/** The columns of the records table every statement of this version reads or writes. */
export const RECORD_COLUMNS: readonly string[] = [
  'scope', 'key', 'fingerprint', 'fingerprint_algorithm', 'state', 'owner_token', 'lease_expires_at', 'response_status',
  'response_headers', 'response_body', 'created_at', 'expires_at', 'steps', 'indeterminate'
]

/** The columns of `<table>_outbox`, needed when the store has an outbox. */
export const OUTBOX_COLUMNS: readonly string[] = [
  'scope', 'key', 'name', 'topic', 'payload', 'delivery_key', 'created_at', 'next_attempt_at', 'attempts', 'last_error', 'delivered_at'
]

const MIGRATE = 'run migrate() (or the SQL in fastify-idempotency/postgres/schema.sql) before serving'

/**
 * The store's boot check (IdempotencyStore.check): one catalog read, which locks no user table, of
 * whether the records table (and the outbox table, when the store has an outbox) exists with every
 * column this version uses. Rejects with StoreNotReadyError naming what is missing and `migrate()`;
 * any other error (the database unreachable, the catalog unreadable) propagates as it is, and the
 * plugin boots with a warning. Indexes are not checked: without them the store is slower, not wrong.
 *
 * `to_regclass` takes the names quoted and schema-qualified, as the DDL writes them, so it finds the
 * very tables `migrate()` creates, and answers NULL (no error) for a table or schema that does not
 * exist. Column names come back as one text (`string_agg`): the driver reads no arrays.
 */
export async function checkSchema (db: DatabaseClient, names: ResolvedNames, outbox: boolean): Promise<void> {
  const id = (name: string): string => db.identifier(name)
  const records = `${id(names.schema)}.${id(names.table)}`
  const outboxTable = `${id(names.schema)}.${id(`${names.table}_outbox`)}`
  const columns = (n: number): string => `(SELECT string_agg(attname::text, ',') FROM pg_attribute
      WHERE attrelid = to_regclass($${n}) AND attnum > 0 AND NOT attisdropped)`
  const { rows } = await db.query(`SELECT to_regclass($1) IS NOT NULL, ${columns(1)}, to_regclass($2) IS NOT NULL, ${columns(2)}`, [records, outboxTable])
  const [hasRecords, recordColumns, hasOutbox, outboxColumns] = (rows[0] ?? []) as [boolean, string | null, boolean, string | null]
  const inSchema = `in schema ${JSON.stringify(names.schema)}`
  if (hasRecords !== true) {
    throw new StoreNotReadyError(`the idempotency tables are missing ${inSchema} (no table ${JSON.stringify(names.table)}): ${MIGRATE}`)
  }
  const lacking = absent(RECORD_COLUMNS, recordColumns)
  if (lacking.length > 0) {
    throw new StoreNotReadyError(`the table ${JSON.stringify(names.table)} ${inSchema} lacks the columns ${lacking.join(', ')}, which this version ` +
      `uses (it was created by an earlier version): ${MIGRATE}`)
  }
  if (!outbox) return
  if (hasOutbox !== true) {
    throw new StoreNotReadyError(`the outbox table ${JSON.stringify(`${names.table}_outbox`)} is missing ${inSchema} (the store has an outbox): ${MIGRATE}`)
  }
  const outboxLacking = absent(OUTBOX_COLUMNS, outboxColumns)
  if (outboxLacking.length > 0) {
    throw new StoreNotReadyError(`the outbox table ${JSON.stringify(`${names.table}_outbox`)} ${inSchema} lacks the columns ${outboxLacking.join(', ')}: ${MIGRATE}`)
  }
}

function absent (needed: readonly string[], present: string | null): string[] {
  const have = new Set((present ?? '').split(','))
  return needed.filter((column) => !have.has(column))
}
