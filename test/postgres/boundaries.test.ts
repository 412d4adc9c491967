import t from 'tap'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { boundaryScenarios } from '../helpers/boundary-scenarios.js'
import { CLIENT_NAME, endPools, storeConnection } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'

/**
 * The lease boundaries on Postgres (lease mode), the same scenarios as on the memory store.
 * The store runs on the client under test (test/helpers/postgres-clients.ts; the node-postgres run:
 * test/postgres/node-postgres/boundaries.test.ts).
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/boundaries.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const { name: schema, sql } = postgresSchema(t, url, { prefix: 'idem_boundaries', client: { max: 10, fetch_types: false } })
  const stores: PostgresStore[] = []
  let tables = 0

  t.teardown(async () => {
    for (const store of stores) await store.close()
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
