import { randomBytes } from 'node:crypto'
import { Redis } from 'ioredis'
import postgres from 'postgres'
import type { Test } from 'tap'
import { postgresStore, type PostgresClient, type PostgresStore } from '../../drivers/postgres/index.js'

/**
 * The real servers `node scripts/test.mjs` provisions (DATABASE_URL, REDIS_URL). Each file gets a
 * schema of its own (dropped at the end) and a Redis key prefix of its own (deleted at the end), so
 * files running in parallel on one server never see each other's records.
 */

export const DATABASE_URL = process.env.DATABASE_URL ?? ''
export const REDIS_URL = process.env.REDIS_URL ?? ''

export interface PostgresFixture {
  readonly sql: PostgresClient
  readonly schema: string
  /** A migrated store on its own table of the schema. */
  readonly store: (table: string) => Promise<PostgresStore>
}

/** Fails the file's test (with how to fix it) when DATABASE_URL is missing; never skips. */
export function postgresFixture (t: Test): PostgresFixture | null {
  if (DATABASE_URL === '') {
    t.fail('DATABASE_URL is not set: run this file through `node scripts/test.mjs <file>`, which starts a throwaway PostgreSQL.')
    return null
  }
  const sql = postgres(DATABASE_URL, { max: 4, onnotice: () => {} })
  const schema = `idem_adv_${randomBytes(4).toString('hex')}`
  const stores: PostgresStore[] = []
  t.teardown(async () => {
    for (const store of stores) await store.close()
    await sql`DROP SCHEMA IF EXISTS ${sql(schema)} CASCADE`
    await sql.end({ timeout: 1 })
  })
  return {
    sql,
    schema,
    async store (table) {
      const store = postgresStore({ sql, schema, table, purgeInterval: 0 })
      await store.migrate()
      stores.push(store)
      return store
    }
  }
}

export interface RedisFixture {
  readonly client: Redis
  readonly prefix: string
  /** Every Redis key under the prefix. */
  readonly keys: () => Promise<string[]>
}

/** Fails the file's test when REDIS_URL is missing; never skips. */
export function redisFixture (t: Test): RedisFixture | null {
  if (REDIS_URL === '') {
    t.fail('REDIS_URL is not set: run this file through `node scripts/test.mjs <file>`, which starts a throwaway Redis.')
    return null
  }
  const client = new Redis(REDIS_URL, { maxRetriesPerRequest: 1 })
  const prefix = `adv${randomBytes(4).toString('hex')}`
  const keys = async (): Promise<string[]> => {
    const found: string[] = []
    let cursor = '0'
    do {
      const [next, batch] = await client.scan(cursor, 'MATCH', `${prefix}:*`, 'COUNT', 1000)
      cursor = next
      found.push(...batch)
    } while (cursor !== '0')
    return found
  }
  t.teardown(async () => {
    const left = await keys()
    if (left.length > 0) await client.del(...left)
    client.disconnect()
  })
  return { client, prefix, keys }
}
