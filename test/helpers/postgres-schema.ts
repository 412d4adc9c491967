/**
 * A PostgreSQL schema of a test's own, so that test files running at the same time on the same
 * database never see each other's tables: created before the test's subtests run, dropped with
 * everything in it when the test ends.
 */
import { randomBytes } from 'node:crypto'
import postgres from 'postgres'
import type { Test } from 'tap'
import { migrate } from '../../drivers/postgres/index.js'

export interface PostgresSchemaOptions {
  /** The schema is named `${prefix}_` and 8 random hex digits ([a-z0-9_], so it needs no escaping). */
  readonly prefix: string
  /** Options for the schema's postgres.js client (notices are always silenced). */
  readonly client?: postgres.Options<Record<string, postgres.PostgresType>>
  /** Store tables to create with the driver's migration (records and outbox) once the schema exists. */
  readonly migrate?: readonly string[]
  /** Anything else the test needs in the schema (tables, functions, triggers), run after the migrations. */
  readonly setup?: (schema: PostgresSchema) => Promise<unknown>
}

export interface PostgresSchema {
  readonly name: string
  /** A postgres.js client on the database, ended once the schema is dropped. */
  readonly sql: postgres.Sql<any>
  /** `"schema".table`, for SQL text. */
  readonly table: (name: string) => string
  /**
   * The schema's creation (with its migrations and setup), started on the first call. The test's
   * subtests wait for it on their own; code in the test's own body awaits it before using the schema.
   */
  readonly ready: () => Promise<void>
}

/**
 * Teardowns run last-registered first: those the test registers after this call (closing its
 * stores, apps, other clients) run before the schema is dropped.
 */
export function postgresSchema (t: Test, url: string, options: PostgresSchemaOptions): PostgresSchema {
  const name = `${options.prefix}_${randomBytes(4).toString('hex')}`
  const sql = postgres(url, { onnotice: () => {}, ...options.client })
  let created: Promise<void> | undefined
  const schema: PostgresSchema = {
    name,
    sql,
    table: (table) => `"${name}".${table}`,
    ready: () => (created ??= (async () => {
      await sql`CREATE SCHEMA ${sql(name)}`
      for (const table of options.migrate ?? []) await migrate(sql, { schema: name, table })
      await options.setup?.(schema)
    })())
  }
  t.before(schema.ready)
  t.teardown(async () => {
    await sql`DROP SCHEMA IF EXISTS ${sql(name)} CASCADE`
    await sql.end({ timeout: 2 })
  })
  return schema
}
