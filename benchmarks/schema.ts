/**
 * The tables server.ts expects in BENCH_SCHEMA: both record tables from the driver's own migrate(),
 * so that the floors write the very same rows as the plugin, and the business table pg-atomic and
 * floor-txn insert into.
 */
import type postgres from 'postgres'
import { migrate } from '../drivers/postgres/index.js'

export const TABLES = ['records', 'floor_records', 'payments'] as const

export async function createBenchSchema (admin: postgres.Sql, schema: string): Promise<void> {
  await admin`CREATE SCHEMA ${admin(schema)}`
  await migrate(admin, { schema, table: 'records' })
  await migrate(admin, { schema, table: 'floor_records' })
  await admin`
    CREATE TABLE ${admin(schema)}.payments (
      id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
      idempotency_key text NOT NULL,
      amount integer NOT NULL,
      currency text NOT NULL,
      created_at timestamptz NOT NULL DEFAULT now()
    )`
}

/** Empties the tables, so that a measurement starts from the same state whatever ran before it. */
export async function truncateBenchSchema (admin: postgres.Sql, schema: string): Promise<void> {
  await admin`TRUNCATE ${admin(schema)}.records, ${admin(schema)}.floor_records, ${admin(schema)}.payments`
}

/** PostgreSQL's settings that bear on the figures. */
export async function describeDatabase (admin: postgres.Sql): Promise<Record<string, string>> {
  const settings = await admin`
    SELECT name, current_setting(name) AS setting FROM pg_settings
    WHERE name IN ('server_version', 'fsync', 'synchronous_commit', 'full_page_writes', 'shared_buffers', 'max_connections')`
  return Object.fromEntries(settings.map((row) => [String(row.name), String(row.setting)]))
}
