/**
 * One job worker of the chaos harness's queue door: a process without Fastify that consumes the
 * jobs the harness's queue (queue.ts) delivers to it over IPC and runs each through
 * `idempotencyRunner` on the shared Postgres store (on postgres.js or node-postgres,
 * CHAOS_PG_CLIENT: database.ts), as a queue consumer would. The harness kills it mid-job, restarts
 * it, and delivers the same job more than once (at least once, with a visibility timeout).
 *
 * A job is a lease-mode payment: its charge at the fake provider is a step (a recovery point), with
 * the provider key `op.deriveKey('charge')`, so a re-run after a takeover replays the charge; then
 * the job pauses `delayMs` (a slow job outlives the queue's visibility timeout, and its message is
 * delivered again while it runs). Its value is the payments API's answer, member for member
 * ({ mode, scope, key, amount, ref }), so the checker reads it as it reads an HTTP 2xx body, and
 * the reconciler's completion of a stuck record (reconcile-policy.ts) is the same value.
 *
 * Every run leaves the same evidence as an app instance's request (evidence.ts): the store calls
 * that decide ownership (the runner's store is wrapped in loggedStore), `fn`'s start and end
 * (`exec-start`, `exec-end`, with the delivery's id as `req`), each step run or refused.
 *
 * Run as `node --import tsx --import ./test/chaos/clock-skew.ts test/chaos/worker.ts` with an IPC
 * channel; configured by CHAOS_* variables. Sends `{ type: 'ready', pid }`; takes
 * `{ type: 'deliver', delivery, job }` and answers `{ type: 'started', delivery }` when `fn` starts
 * and `{ type: 'result', delivery, outcome }` when the run ends; exits when the channel closes.
 */
import { idempotencyRunner } from '../../lib/index.js'
import { postgresStore } from '../../drivers/postgres/index.js'
import { openDatabase, pgClientFromEnv } from './database.js'
import { evidenceLog, loggedStore, watchStalls } from './evidence.js'
import type { AttemptOutcome } from './history.js'
import { post } from './http.js'
import type { JobDelivery } from './queue.js'
import { sleep } from '../helpers/sleep.js'

const need = (name: string): string => {
  const value = process.env[name]
  if (value === undefined || value === '') throw new Error(`chaos worker: ${name} is required`)
  return value
}
if (process.send === undefined) throw new Error('chaos worker: an IPC channel is required')

/** The evidence's `instance` of this worker (queue.ts, WORKER_INSTANCE_BASE + its index). */
const instance = Number(need('CHAOS_INSTANCE'))
const providerPort = Number(need('CHAOS_PROVIDER_PORT'))
const leaseMs = Number(need('CHAOS_LEASE_MS'))
const waitMs = Number(need('CHAOS_WAIT_MS'))
const retryAfterMs = Number(need('CHAOS_RETRY_AFTER_MS'))
const storeTimeoutMs = Number(process.env.CHAOS_STORE_TIMEOUT_MS ?? '2000')
const providerTimeoutMs = Number(process.env.CHAOS_PROVIDER_TIMEOUT_MS ?? '1500')
/** The runner's default ttl: what exec-start reports (the checker's "long retention"). */
const TTL_MS = 86_400_000

const log = evidenceLog(need('CHAOS_EVIDENCE'), instance)
watchStalls(log)

// application_name under chaos-app-: the pg-terminate fault ends the workers' backends as well.
const database = openDatabase(pgClientFromEnv(process.env.CHAOS_PG_CLIENT), { url: need('CHAOS_DATABASE_URL'), max: 6, applicationName: `chaos-app-worker-${instance}` })
const store = loggedStore(postgresStore({ ...database.connection, purgeInterval: 0 }), log)
const runner = idempotencyRunner({ store, lease: leaseMs, wait: waitMs, storeTimeout: storeTimeoutMs, retryAfter: retryAfterMs, ttl: TTL_MS })

const send = (message: object): void => {
  // A message lost because the channel closed (the harness is stopping) is only lost: with a
  // callback, the failed write is not an 'error' event that would end the process.
  try { process.send?.(message, () => {}) } catch {}
}

async function runJob ({ delivery, job }: JobDelivery): Promise<AttemptOutcome> {
  const req = `d${delivery}`
  try {
    const { value, replayed } = await runner.run({
      key: job.key,
      scope: job.scope,
      operation: 'charge',
      // The fingerprinted input: the same on every delivery of the message; another amount under the key is refused.
      payload: { amount: job.amount, currency: 'EUR' }
    }, async (op) => {
      log({ ev: 'exec-start', req, scope: job.scope, key: job.key, route: 'job', leaseMs, ttlMs: TTL_MS })
      send({ type: 'started', delivery })
      try {
        log({ ev: 'step-call', req, name: 'charge' })
        const charge = await op.step('charge', async () => {
          log({ ev: 'step-run', req, name: 'charge' })
          const result = await chargeAtProvider(op.deriveKey('charge'), job.scope, job.key, job.amount)
          log({ ev: 'step-done', req, name: 'charge' })
          return result
        }).catch((err: unknown) => {
          if ((err as Error).name === 'LeaseLostError') log({ ev: 'step-refused', req, name: 'charge', error: (err as Error).message })
          throw err
        })
        await sleep(job.delayMs)
        log({ ev: 'exec-end', req, how: 'returned' })
        // The members in the order app.ts and reconcile-policy.ts write them: the same bytes as JSON.
        return { mode: 'lease', scope: job.scope, key: job.key, amount: job.amount, ref: charge.id }
      } catch (err) {
        log({ ev: 'exec-end', req, how: 'threw', error: (err as Error).name })
        throw err
      }
    })
    return { kind: 'response', status: 200, replayed, body: JSON.stringify(value), retryAfter: null }
  } catch (err) {
    // The runner's refusals, as the HTTP door answers them, so the checker reads both doors alike.
    const code = (err as { code?: unknown }).code
    const body = JSON.stringify({ error: (err as Error).name, code: typeof code === 'string' ? code : null })
    switch (code) {
      case 'FST_IDEMPOTENCY_IN_PROGRESS':
        return { kind: 'response', status: 409, replayed: false, body, retryAfter: (err as { retryAfter: number }).retryAfter / 1000 }
      case 'FST_IDEMPOTENCY_MISMATCH':
        return { kind: 'response', status: 422, replayed: false, body, retryAfter: null }
      case 'FST_IDEMPOTENCY_STORE_UNAVAILABLE':
        return { kind: 'response', status: 503, replayed: false, body, retryAfter: null }
      default:
        // fn's own failure (the provider unreachable, a lost lease): the key was released or held.
        return { kind: 'response', status: 500, replayed: false, body, retryAfter: null }
    }
  }
}

/** Any failure (a timeout, a reset, a non-201) throws: the step is not recorded and the run releases its key. */
async function chargeAtProvider (providerKey: string, scope: string, key: string, amount: number): Promise<{ id: string, amount: number }> {
  const result = await post(providerPort, '/charges', {
    'content-type': 'application/json',
    'idempotency-key': providerKey
  }, JSON.stringify({ amount, currency: 'EUR', scope, key }), providerTimeoutMs)
  if (!result.ok) throw new Error(`provider unreachable: ${result.error}`)
  if (result.status !== 201) throw new Error(`provider answered ${result.status}: ${result.body}`)
  return JSON.parse(result.body) as { id: string, amount: number }
}

process.on('message', (message: unknown) => {
  const m = message as (JobDelivery & { type?: unknown }) | null
  if (m?.type !== 'deliver') return
  void runJob(m).then((outcome) => send({ type: 'result', delivery: m.delivery, outcome }))
})
process.on('disconnect', () => process.exit(0))

process.send({ type: 'ready', pid: process.pid })
