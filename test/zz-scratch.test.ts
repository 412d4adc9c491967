import t from 'tap'
t.test('x', async t => { t.ok(process.env.DATABASE_URL); t.ok(process.env.REDIS_URL); t.ok(process.env.REDIS_CLUSTER_NODES); t.comment(JSON.stringify([process.env.DATABASE_URL, process.env.REDIS_URL, process.env.REDIS_CLUSTER_NODES, process.env.PG_BIN_DIR, process.env.REDIS_SERVER_BIN])) })
