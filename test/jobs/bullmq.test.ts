import { spawn, type ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { createInterface } from 'node:readline'
import { fileURLToPath, pathToFileURL } from 'node:url'
import { Queue, type Job } from 'bullmq'
import { Redis } from 'ioredis'
import t, { type Test } from 'tap'
import { deriveKey } from '../../lib/core/derive.js'
import { endPools } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'
import { writeRecipe } from './recipes.js'

/**
 * docs/jobs.md's BullMQ recipe, run as written: workers in child processes (one can be SIGKILLed
 * mid-job) on a real Redis (REDIS_URL), the runner's records on a real PostgreSQL (DATABASE_URL), and
 * fake providers whose calls are rows in PostgreSQL, so what a killed worker did is still counted.
 * The checks count those calls (`charges`, `invoices`), read the jobs' outcomes from BullMQ and the
 * records from the store's table.
 */

const DATABASE_URL = process.env.DATABASE_URL
const REDIS_URL = process.env.REDIS_URL
if (DATABASE_URL === undefined || DATABASE_URL === '' || REDIS_URL === undefined || REDIS_URL === '') {
  t.fail('DATABASE_URL or REDIS_URL is not set: run `node scripts/test.mjs test/jobs/bullmq.test.ts` (it provisions a throwaway PostgreSQL and Redis).')
} else {
  suite(DATABASE_URL, REDIS_URL)
}

const FIXTURE = fileURLToPath(new URL('../fixtures/bullmq-worker.ts', import.meta.url))
const HEADING = 'BullMQ: recovery points, and a stalled job taken over'
/**
 * The runner's lease and BullMQ's lockDuration (the recipe gives both the same value): a killed
 * worker's job comes back about this long after its last renewal. Short, so the test is quick;
 * long enough that a live worker on a busy machine renews in time (every third of it for the key,
 * every half for BullMQ's lock).
 */
const LEASE = 2000
const STALLED_INTERVAL = 500

interface InvoiceJob { orderId: number, amount: number }
interface InvoiceResult { invoice: { invoiceId: string, chargeId: string }, replayed: boolean }
interface Recipe {
  enqueueInvoice (queue: Queue<InvoiceJob>, job: InvoiceJob): Promise<string | undefined>
}

interface WorkerProcess {
  readonly child: ChildProcess
  /** The next stdout message carrying `field` (bounded wait), removed from the queue. */
  next (field: string, limitMs?: number): Promise<unknown>
  /** SIGKILL, and wait until the process is gone. */
  kill (): Promise<void>
}

function suite (databaseUrl: string, redisUrl: string): void {
  const { name: schema, sql } = postgresSchema(t, databaseUrl, {
    prefix: 'idem_bullmq',
    client: { max: 2 },
    migrate: ['records'],
    setup: async ({ sql, name }) => {
      await sql`CREATE TABLE ${sql(name)}.charges (id serial PRIMARY KEY, order_id integer NOT NULL, amount integer NOT NULL, idempotency_key text NOT NULL, pid integer NOT NULL)`
      await sql`CREATE TABLE ${sql(name)}.invoices (id serial PRIMARY KEY, order_id integer NOT NULL, charge_id text NOT NULL, idempotency_key text NOT NULL, pid integer NOT NULL)`
    }
  })
  // Every test has a queue of its own, so that no worker of one test takes another's jobs.
  const queueName = (): string => `invoices-${randomBytes(4).toString('hex')}`
  const connection = new Redis(redisUrl, { maxRetriesPerRequest: null })
  let recipeFile = ''
  let recipe: Recipe

  t.before(async () => {
    recipeFile = writeRecipe(t, HEADING)
    recipe = await import(pathToFileURL(recipeFile).href) as Recipe
  })
  t.teardown(async () => {
    connection.disconnect()
    await endPools()
  })

  function worker (t: Test, queue: string, options: { crash?: boolean, sendDelay?: number } = {}): Promise<WorkerProcess> {
    const child = spawn(process.execPath, ['--import', 'tsx', FIXTURE], {
      env: {
        ...process.env,
        RECIPE: recipeFile,
        DATABASE_URL: databaseUrl,
        REDIS_URL: redisUrl,
        IDEM_SCHEMA: schema,
        QUEUE: queue,
        LEASE: String(LEASE),
        STALLED_INTERVAL: String(STALLED_INTERVAL),
        SEND_DELAY: String(options.sendDelay ?? 0),
        CRASH: options.crash === true ? 'after-charge' : ''
      },
      stdio: ['ignore', 'pipe', 'inherit']
    })
    t.teardown(() => { child.kill('SIGKILL') })
    const messages: Array<Record<string, unknown>> = []
    createInterface({ input: child.stdout as NodeJS.ReadableStream }).on('line', (line) => {
      try { messages.push(JSON.parse(line) as Record<string, unknown>) } catch {}
    })
    const next = async (field: string, limitMs = 20_000): Promise<unknown> => {
      const deadline = Date.now() + limitMs
      for (;;) {
        const index = messages.findIndex((m) => field in m)
        if (index >= 0) return messages.splice(index, 1)[0]?.[field]
        if (Date.now() > deadline || child.exitCode !== null) throw new Error(`the worker did not report ${field}`)
        await sleep(25)
      }
    }
    const kill = async (): Promise<void> => {
      if (child.exitCode !== null || child.signalCode !== null) return
      const gone = new Promise<void>((resolve) => child.once('exit', () => resolve()))
      child.kill('SIGKILL')
      await gone
    }
    return next('ready').then(() => ({ child, next, kill }))
  }

  /** The test's queue, emptied and closed when `t` ends. */
  function queueOf (t: Test, name: string): Queue<InvoiceJob> {
    const queue = new Queue<InvoiceJob>(name, { connection })
    t.teardown(async () => {
      await queue.obliterate({ force: true }).catch(() => {})
      await queue.close()
    })
    return queue
  }

  /**
   * The job once BullMQ settled it for good: completed, or failed with no attempt left. Polled, since
   * a job that fails and is retried, or is moved to delayed, comes back to the same states meanwhile.
   */
  async function settled (queue: Queue<InvoiceJob>, id: string | undefined, limitMs = 30_000): Promise<Job<InvoiceJob>> {
    const deadline = Date.now() + limitMs
    for (;;) {
      const job = id === undefined ? undefined : await queue.getJob(id)
      if (job === undefined) throw new Error(`job ${String(id)} is not in the queue`)
      const state = await job.getState()
      // Read again: the job read above may predate the move to this state (and its return value).
      if (state === 'completed' || state === 'failed') return await queue.getJob(job.id ?? '') ?? job
      if (Date.now() > deadline) throw new Error(`job ${String(id)} is still ${state} after ${limitMs} ms (${job.failedReason ?? ''})`)
      await sleep(50)
    }
  }

  /** A job that must complete: the job and its return value. */
  async function completed (queue: Queue<InvoiceJob>, id: string | undefined): Promise<{ job: Job<InvoiceJob>, result: InvoiceResult }> {
    const job = await settled(queue, id)
    if (await job.getState() !== 'completed') throw new Error(`job ${String(id)} failed: ${job.failedReason}`)
    return { job, result: job.returnvalue as InvoiceResult }
  }

  const count = async (table: 'charges' | 'invoices', orderId: number): Promise<number> =>
    Number((await sql`SELECT count(*)::int AS n FROM ${sql(schema)}.${sql(table)} WHERE order_id = ${orderId}`)[0]?.n)
  const record = async (key: string): Promise<{ state: string, steps: string[] } | null> => {
    const [row] = await sql`SELECT state, steps FROM ${sql(schema)}.records WHERE key = ${key}`
    return row === undefined ? null : { state: String(row.state), steps: Object.keys(row.steps as object).sort() }
  }

  t.test('a worker SIGKILLed after the charge: BullMQ hands the stalled job to the other worker, which takes the key over and does not charge again', async (t) => {
    const name = queueName()
    const queue = queueOf(t, name)
    const doomed = await worker(t, name, { crash: true })
    const orderId = 42
    const id = await recipe.enqueueInvoice(queue, { orderId, amount: 1000 })
    t.equal(await doomed.next('between'), orderId, 'the first worker charged and reached the invoice call')
    t.equal(await count('charges', orderId), 1)

    const survivor = await worker(t, name)
    await doomed.kill()
    const killedAt = Date.now()
    const { job, result } = await completed(queue, id)
    t.equal(await job.getState(), 'completed')
    t.equal(job.stalledCounter, 1, 'BullMQ moved the job back to wait once, as stalled')
    t.ok(job.attemptsStarted >= 2, `the job was started again after the kill (${job.attemptsStarted} starts)`)
    t.equal(result.replayed, false, 'the taking-over delivery ran the operation (from its recorded step)')
    t.equal(await count('charges', orderId), 1, 'the charge step did not run again: one call to the provider')
    t.equal(await count('invoices', orderId), 1, 'one invoice, sent by the survivor')
    const [charge] = await sql`SELECT id, idempotency_key, pid FROM ${sql(schema)}.charges WHERE order_id = ${orderId}`
    t.equal(charge?.pid, doomed.child.pid, 'the charge is the killed worker\'s')
    t.equal(charge?.idempotency_key, deriveKey('', `invoice-${orderId}`, 'charge'), 'it carried the derived key')
    t.same(result.invoice.chargeId, `ch_${String(charge?.id)}`, 'the recorded charge reached the survivor')
    const [invoice] = await sql`SELECT id, pid FROM ${sql(schema)}.invoices WHERE order_id = ${orderId}`
    t.equal(invoice?.pid, survivor.child.pid)
    t.equal(result.invoice.invoiceId, `in_${String(invoice?.id)}`)
    t.same(await record(`invoice-${orderId}`), { state: 'completed', steps: ['charge', 'send'] })
    t.comment(`finished ${Date.now() - killedAt} ms after the kill`)

    // The producer enqueues the same invoice again: answered from the record, nothing called.
    const again = await completed(queue, await recipe.enqueueInvoice(queue, { orderId, amount: 1000 }))
    t.same(again.result, { invoice: result.invoice, replayed: true }, 'a later delivery of the completed job is a replay')
    t.equal(await count('charges', orderId), 1)
    t.equal(await count('invoices', orderId), 1)
  })

  t.test('two jobs with the same key at once on two workers: one charge, one invoice; the duplicate is delayed and replays', async (t) => {
    const name = queueName()
    const queue = queueOf(t, name)
    // The invoice call takes a while, so the second worker takes the duplicate while the first still runs.
    const workers = await Promise.all([worker(t, name, { sendDelay: 1000 }), worker(t, name, { sendDelay: 1000 })])
    const orderId = 43
    const ids = await Promise.all([
      recipe.enqueueInvoice(queue, { orderId, amount: 500 }),
      recipe.enqueueInvoice(queue, { orderId, amount: 500 })
    ])
    t.not(ids[0], ids[1], 'two jobs')
    const outcomes = await Promise.all(ids.map(async (id) => await completed(queue, id)))
    const ran = outcomes.filter((o) => !o.result.replayed)
    const replayed = outcomes.filter((o) => o.result.replayed)
    t.equal(ran.length, 1, 'one delivery ran the operation')
    t.equal(replayed.length, 1, 'the other replayed it')
    t.same(replayed[0]?.result.invoice, ran[0]?.result.invoice, 'with the same invoice')
    t.ok((replayed[0]?.job.attemptsStarted ?? 0) >= 2, 'the duplicate met the original in flight, was delayed, and came back')
    t.equal(replayed[0]?.job.attemptsMade, 1, 'being delayed spent none of its attempts: only its completion counts')
    t.equal(await count('charges', orderId), 1)
    t.equal(await count('invoices', orderId), 1)
    for (const w of workers) await w.kill()
  })

  t.test('the same order with another amount: KeyReusedError fails the job for good, without retries or a charge', async (t) => {
    const name = queueName()
    const queue = queueOf(t, name)
    await worker(t, name)
    const orderId = 44
    const first = await completed(queue, await recipe.enqueueInvoice(queue, { orderId, amount: 700 }))
    t.equal(first.result.replayed, false)
    const failed = await settled(queue, await recipe.enqueueInvoice(queue, { orderId, amount: 800 }))
    t.equal(await failed.getState(), 'failed')
    t.equal(failed.attemptsMade, 1, 'once: an UnrecoverableError is not retried, whatever the attempts')
    t.equal(failed.stacktrace?.length, 1, 'one failure recorded')
    t.match(failed.stacktrace?.[0], /^UnrecoverableError/, 'the recipe\'s refusal of a reused key')
    t.equal(await count('charges', orderId), 1, 'nothing charged for it')
    t.equal(await count('invoices', orderId), 1)
    const again = await completed(queue, await recipe.enqueueInvoice(queue, { orderId, amount: 700 }))
    t.same(again.result, { invoice: first.result.invoice, replayed: true }, 'the record is untouched: the first amount still replays')
  })
}
