// test/jobs/runner.test.ts with the PostgreSQL store on node-postgres (test/helpers/postgres-clients.ts).
process.env.IDEM_PG_CLIENT = 'pg'
await import('../runner.test.js')
