import { randomBytes } from 'node:crypto'
import PgBoss from 'pg-boss'
import postgres from 'postgres'
import t from 'tap'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'
import { loadRecipe } from './recipes.js'

/**
 * docs/jobs.md's pg-boss recipe, run as written against PostgreSQL (DATABASE_URL): pg-boss in a schema
 * of its own, the runner in atomic mode on the store's table in another, and the job's business
 * writes (an invoice row, the order's invoice_id) made through `op.sql`, so they commit with the
 * recorded value or roll back with the claim. The checks count rows and read the jobs' outcomes from
 * pg-boss.
 *
 * pg-boss 10 is the version installed (it runs on Node 20); the recipe imports nothing from pg-boss
 * and uses only what 10 and later versions share.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/jobs/pg-boss.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

const HEADING = "pg-boss: atomic mode, the job's writes and its record in one transaction"

interface InvoiceJob { orderId: number, amount: number }
interface InvoiceResult { invoiceId: number, replayed: boolean }
interface Recipe {
  readonly QUEUE: string
  readonly REFUSED: string
  startInvoiceWorker (boss: PgBoss, store: PostgresStore, options?: { pollingIntervalSeconds?: number }): Promise<string>
}

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const appName = `idem-pgboss-${id}`
  const bossSchema = `idem_pgboss_queue_${id}`
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_pgboss',
    client: { max: 3 },
    migrate: ['records'],
    setup: async ({ sql, name }) => {
      await sql`CREATE TABLE ${sql(name)}.orders (id integer PRIMARY KEY, invoice_id integer)`
      await sql`CREATE TABLE ${sql(name)}.invoices (id serial PRIMARY KEY, order_id integer NOT NULL, amount integer NOT NULL)`
    }
  })
  // The recipe's tables are unqualified (`invoices`, `orders`), as in an app: found through search_path.
  const sql = postgres(url, { max: 6, onnotice: () => {}, connection: { application_name: appName, search_path: schema } })
  const store = postgresStore({ sql, schema, table: 'records', purgeInterval: 0 })
  const boss = new PgBoss({ connectionString: url, schema: bossSchema, max: 4, schedule: false, supervise: false })
  const bossErrors: unknown[] = []
  boss.on('error', (err) => { bossErrors.push(err) })
  let recipe: Recipe

  t.before(async () => {
    recipe = await loadRecipe<Recipe>(t, HEADING)
    await boss.start()
    // Two workers on the queue, as two processes would have: two deliveries can run at once.
    for (let i = 0; i < 2; i++) await recipe.startInvoiceWorker(boss, store, { pollingIntervalSeconds: 0.5 })
  })
  t.teardown(async () => {
    await boss.stop({ graceful: false, wait: true }).catch(() => {})
    await store.close()
    await sql.end({ timeout: 2 })
    await admin`DROP SCHEMA IF EXISTS ${admin(bossSchema)} CASCADE`
  })

  const invoices = async (orderId: number): Promise<Array<{ id: number, amount: number }>> =>
    (await admin`SELECT id, amount FROM ${admin(schema)}.invoices WHERE order_id = ${orderId} ORDER BY id`).map((row) => ({ id: Number(row.id), amount: Number(row.amount) }))
  const orderInvoice = async (orderId: number): Promise<number | null> => {
    const [row] = await admin`SELECT invoice_id FROM ${admin(schema)}.orders WHERE id = ${orderId}`
    return row === undefined || row.invoice_id === null ? null : Number(row.invoice_id)
  }
  const records = async (key: string): Promise<string[]> =>
    (await admin`SELECT state FROM ${admin(schema)}.records WHERE key = ${key}`).map((row) => String(row.state))

  /** Polls pg-boss until the job is in one of `states`; resolves it, with its output. */
  async function job (jobId: string, states: readonly string[], limitMs = 30_000): Promise<PgBoss.JobWithMetadata<InvoiceJob>> {
    const deadline = Date.now() + limitMs
    for (;;) {
      const found = await boss.getJobById<InvoiceJob>(recipe.QUEUE, jobId)
      if (found !== null && states.includes(found.state)) return found
      if (Date.now() > deadline) throw new Error(`job ${jobId} is ${found?.state ?? 'gone'}, not ${states.join(' or ')}, after ${limitMs} ms`)
      await sleep(50)
    }
  }
  async function send (data: InvoiceJob): Promise<string> {
    const jobId = await boss.send(recipe.QUEUE, data)
    if (jobId === null) throw new Error('pg-boss did not create the job')
    return jobId
  }
  /** What the handler returned for the job's delivery that completed it (pg-boss keeps it as the job's output). */
  const resultsOf = (found: PgBoss.JobWithMetadata<InvoiceJob>): InvoiceResult[] => (found.output as { invoices: InvoiceResult[] }).invoices

  t.test('a job that fails after its insert leaves no invoice and no record; pg-boss retries it and the retry writes one', async (t) => {
    const orderId = 1
    // No order row yet: the recipe's UPDATE finds nothing to invoice and throws, after its INSERT.
    const jobId = await send({ orderId, amount: 100 })
    const retried = await job(jobId, ['retry'])
    t.match(retried.output, { message: `order ${orderId} is not waiting for an invoice` }, 'pg-boss failed the job with the operation\'s own error, and will retry it')
    t.same(await invoices(orderId), [], 'the invoice inserted before the failure rolled back with the claim')
    t.same(await records(`invoice-${orderId}`), [], 'and no record holds the key')

    await admin`INSERT INTO ${admin(schema)}.orders (id) VALUES (${orderId})`
    const done = await job(jobId, ['completed'])
    const written = await invoices(orderId)
    t.equal(written.length, 1, 'the retry ran the operation afresh and wrote one invoice')
    t.same(resultsOf(done), [{ invoiceId: written[0]?.id, replayed: false }], 'the job\'s output is the recorded value')
    t.equal(await orderInvoice(orderId), written[0]?.id, 'the order points at it: both writes committed together')
    t.same(await records(`invoice-${orderId}`), ['completed'])
  })

  t.test('a completed job delivered again is replayed: no second invoice', async (t) => {
    const orderId = 2
    await admin`INSERT INTO ${admin(schema)}.orders (id) VALUES (${orderId})`
    const first = resultsOf(await job(await send({ orderId, amount: 200 }), ['completed']))
    t.equal(first[0]?.replayed, false)
    const again = resultsOf(await job(await send({ orderId, amount: 200 }), ['completed']))
    t.same(again, [{ invoiceId: first[0]?.invoiceId, replayed: true }], 'the second job got the recorded value')
    t.equal((await invoices(orderId)).length, 1)
  })

  t.test('two deliveries at once: the duplicate waits for the original\'s commit and replays it; one invoice', async (t) => {
    const orderId = 3
    await admin`INSERT INTO ${admin(schema)}.orders (id) VALUES (${orderId})`
    // Hold the order's row: the first delivery's UPDATE waits on it with its claim uncommitted, so
    // the second delivery reaches the claim while the first is in flight, and waits on it.
    const blocker = postgres(url, { max: 1, onnotice: () => {} })
    t.teardown(() => blocker.end({ timeout: 2 }))
    let release!: () => void
    const released = new Promise<void>((resolve) => { release = resolve })
    const holding = blocker.begin(async (tx) => {
      await tx`SELECT id FROM ${tx(schema)}.orders WHERE id = ${orderId} FOR UPDATE`
      await released
    })
    try {
      const ids = await Promise.all([send({ orderId, amount: 300 }), send({ orderId, amount: 300 })])
      // Both jobs active at once, while the first holds its claim uncommitted behind the blocker: the
      // second is then inside run(), waiting for the first (on its lock, or between two looks at it).
      // Sampling the lock waits themselves would miss a duplicate that is between two looks.
      const deadline = Date.now() + 4_000 // under the recipe's wait (5 s)
      let active = 0
      let locked = 0
      while (Date.now() < deadline) {
        const states = await Promise.all(ids.map(async (jobId) => (await boss.getJobById<InvoiceJob>(recipe.QUEUE, jobId))?.state))
        active = states.filter((state) => state === 'active').length
        locked = Number((await admin`SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = ${appName} AND wait_event_type = 'Lock'`)[0]?.n)
        if (active === 2 && locked >= 1) break
        await sleep(25)
      }
      t.equal(active, 2, 'both deliveries were in flight at once')
      t.ok(locked >= 1, `the first waits on the order's row with its claim open (${locked} waiting on a lock)`)
      release()
      await holding
      const outcomes = await Promise.all(ids.map(async (jobId) => resultsOf(await job(jobId, ['completed']))[0]))
      const ran = outcomes.filter((o) => o?.replayed === false)
      t.equal(ran.length, 1, 'one delivery ran the operation')
      t.same(outcomes.filter((o) => o?.replayed === true), [{ invoiceId: ran[0]?.invoiceId, replayed: true }], 'the other replayed it')
      t.equal((await invoices(orderId)).length, 1, 'one invoice')
    } finally {
      release()
      await holding.catch(() => {})
    }
  })

  t.test('the same order with another amount: the job is refused into the refused queue, with nothing written', async (t) => {
    const orderId = 4
    await admin`INSERT INTO ${admin(schema)}.orders (id) VALUES (${orderId})`
    await job(await send({ orderId, amount: 400 }), ['completed'])
    const refused = await job(await send({ orderId, amount: 401 }), ['completed', 'failed'])
    t.equal(refused.state, 'completed', 'not retried: a retry would get the same refusal')
    t.same(resultsOf(refused), [], 'it recorded nothing')
    const parked = await boss.fetch<InvoiceJob & { reason: string }>(recipe.REFUSED)
    t.equal(parked.length, 1, 'one job in the refused queue')
    t.match(parked[0]?.data, { orderId, amount: 401, reason: /./ })
    t.same((await invoices(orderId)).map((i) => i.amount), [400], 'only the first amount was invoiced')
    t.same(bossErrors, [], 'pg-boss reported no error')
  })
}
