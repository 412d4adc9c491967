import { randomBytes } from 'node:crypto'
import postgres from 'postgres'
import t from 'tap'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { boundaryScenarios } from '../helpers/boundary-scenarios.js'
import { CLIENT_NAME, endPools, storeConnection } from '../helpers/postgres-clients.js'

/**
 * Issue 12's lease boundaries on Postgres (lease mode), the same scenarios as on the memory store.
 * The store runs on the client under test (test/helpers/postgres-clients.ts; the node-postgres run:
 * test/drivers/node-postgres/postgres-boundaries.test.ts).
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/drivers/postgres-boundaries.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const schema = `idem_boundaries_${randomBytes(4).toString('hex')}`
  const sql = postgres(url, { max: 10, onnotice: () => {}, fetch_types: false })
  const stores: PostgresStore[] = []
  let tables = 0

  t.before(async () => { await sql`CREATE SCHEMA ${sql(schema)}` })
  t.teardown(async () => {
    for (const store of stores) await store.close()
    await sql`DROP SCHEMA IF EXISTS ${sql(schema)} CASCADE`
    await sql.end({ timeout: 1 })
    await endPools()
  })

  t.comment(`store on ${CLIENT_NAME}`)
  boundaryScenarios(t, {
    store: async () => {
      const store = postgresStore({ ...storeConnection(sql), schema, table: `records_${++tables}`, purgeInterval: 0 })
      await store.migrate()
      stores.push(store)
      return store
    }
  })
}
