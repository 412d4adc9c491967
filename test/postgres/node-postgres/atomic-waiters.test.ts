// test/postgres/atomic-waiters.test.ts with the store on node-postgres (test/helpers/postgres-clients.ts).
process.env.IDEM_PG_CLIENT = 'pg'
await import('../atomic-waiters.test.js')
