import { spawn, type ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import t from 'tap'
import { CLIENT, CLIENT_NAME } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Atomic mode while PostgreSQL drops the connections under open transactions: an app process
 * (test/fixtures/postgres-dropped-connection-server.ts) serves a stream of atomic-mode requests and
 * this test terminates the backends of its open transactions (`pg_terminate_backend`, what a
 * failover or an administrator does). postgres.js 3.4.9 crashes a process that sends anything on a
 * transaction's connection after it closed (`TypeError … at Immediate.nextWrite`,
 * porsager/postgres#1208): the driver must never do so, and the process must keep serving. Every
 * request gets its committed answer or a documented problem, and no key executes twice.
 *
 * The fixture's store runs on the client under test (IDEM_PG_CLIENT, test/helpers/postgres-clients.ts;
 * test/postgres/node-postgres/dropped-connection.test.ts runs this on node-postgres). There
 * the crash has another form: node-postgres emits a checked-out client's connection error as an
 * 'error' event, and an EventEmitter with no listener throws it (the store listens on each client
 * it checks out, and on the pool for idle ones). This test's own postgres.js client (`admin`)
 * only sets up, terminates and reads rows.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/dropped-connection.test.ts` (it provisions a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

const FIXTURE = fileURLToPath(new URL('../fixtures/postgres-dropped-connection-server.ts', import.meta.url))
const REQUESTS = 1000
const CONCURRENCY = 8
/**
 * One termination per this many answers (polled every few ms): a few hundred over the run, each
 * hitting an open transaction. Paced by the requests' progress, not by the clock: at one every
 * 10 ms, a machine busy with other tests served fewer requests between terminations, and a run
 * killed 466 backends for 1,000 requests, 770 of them answered 503 while the pool reconnected.
 */
const ANSWERS_PER_TERMINATION = 3
const POLL_MS = 5
/** Enough deaths to show the crash is there; more would only make the failing run slower. */
const MAX_DEATHS = 3
/** What a crash looks like on stderr: postgres.js's write on a closed socket, or node-postgres's unheard 'error' event. */
const CRASH_SIGNATURE = CLIENT === 'pg'
  ? /Unhandled 'error' event|Emitted 'error' event on (?:Client|BoundPool|Pool) instance/
  : /reading 'write'\)[\s\S]*at Immediate\.nextWrite \(.*postgres\/src\/connection\.js/
const CRASH_NAME = CLIENT === 'pg' ? "an unheard 'error' event of node-postgres" : 'TypeError at Immediate.nextWrite (porsager/postgres#1208)'
const TYPE_BASE = 'tag:fastify-idempotency,2026:'

type Outcome = 'committed' | 'outcome-unknown' | 'store-unavailable' | 'not-committed' | 'handler-error' | 'request-in-progress' | 'lost'
interface Answer { readonly outcome: Outcome, readonly status: number, readonly id: number | null }

interface Instance { readonly child: ChildProcess, readonly port: number, stderr: string }

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const application = `idem-dropped-${id}`
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_dropped',
    client: { max: 3 },
    migrate: ['records'],
    // No unique constraint on key: a second execution must show up as a second row, not as an error.
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.payments (id serial PRIMARY KEY, key text NOT NULL, amount integer NOT NULL)`
  })

  const children = new Set<ChildProcess>()
  t.teardown(() => { for (const child of children) child.kill('SIGKILL') })

  function start (): Promise<Instance> {
    const child = spawn(process.execPath, ['--import', 'tsx', FIXTURE], {
      env: { ...process.env, DATABASE_URL: url, IDEM_SCHEMA: schema, IDEM_APP: application },
      stdio: ['ignore', 'pipe', 'pipe']
    })
    children.add(child)
    child.once('exit', () => { children.delete(child) })
    return new Promise((resolve, reject) => {
      const stderr = ''
      const instance = { child, port: 0, stderr }
      child.stderr?.on('data', (chunk: Buffer) => { instance.stderr = (instance.stderr + chunk.toString()).slice(-8_000) })
      child.once('exit', (code) => reject(new Error(`the fixture exited (${String(code)}) before listening: ${instance.stderr}`)))
      createInterface({ input: child.stdout as NodeJS.ReadableStream }).on('line', (line) => {
        try {
          const message = JSON.parse(line) as { port?: number }
          if (typeof message.port === 'number') resolve(Object.assign(instance, { port: message.port }))
        } catch {}
      })
    })
  }

  async function pay (port: number, key: string, amount: number): Promise<Answer & { replayed: boolean, key: string | null }> {
    let response: Response
    try {
      response = await fetch(`http://127.0.0.1:${port}/pay`, {
        method: 'POST',
        headers: { 'idempotency-key': `"${key}"`, 'content-type': 'application/json' },
        body: JSON.stringify({ amount })
      })
    } catch {
      return { outcome: 'lost', status: 0, id: null, replayed: false, key: null }
    }
    const text = await response.text()
    const body = JSON.parse(text) as { id?: number, key?: string, type?: string }
    const replayed = response.headers.get('idempotent-replayed') === 'true'
    if (response.status === 201) return { outcome: 'committed', status: 201, id: body.id ?? null, replayed, key: body.key ?? null }
    const kind = typeof body.type === 'string' && body.type.startsWith(TYPE_BASE) ? body.type.slice(TYPE_BASE.length) : null
    if (response.status === 503 && (kind === 'outcome-unknown' || kind === 'store-unavailable')) return { outcome: kind, status: 503, id: null, replayed, key: null }
    // A claim retried while the terminated backend's transaction had not finished rolling back sees
    // that uncommitted claim: 409, the documented answer to an attempt in flight (seen once on Node 24).
    if (response.status === 409 && kind === 'request-in-progress') return { outcome: kind, status: 409, id: null, replayed, key: null }
    if (response.status === 500 && kind === 'not-committed') return { outcome: 'not-committed', status: 500, id: null, replayed, key: null }
    // The handler's own query failed (its connection was gone): a thrown error, rolled back (docs/drivers.md).
    if (response.status === 500 && kind === null) return { outcome: 'handler-error', status: 500, id: null, replayed, key: null }
    throw new Error(`${key}: unexpected answer ${response.status} ${text}`)
  }

  t.test(`${CLIENT_NAME}: backends terminated under open transactions during 1,000 atomic-mode requests: no process death, every answer committed or a documented problem, no key executed twice`, async (t) => {
    const deaths: string[] = []
    let current = start()
    let stopping = false
    const watch = (instance: Instance): void => {
      instance.child.once('exit', (code, signal) => {
        if (stopping) return
        deaths.push(instance.stderr)
        t.comment(`the app process died (${signal ?? String(code)}): ${CRASH_SIGNATURE.test(instance.stderr) ? CRASH_NAME : instance.stderr.slice(-600)}`)
        if (deaths.length < MAX_DEATHS) current = start().then((next) => { watch(next); return next })
      })
    }
    watch(await current)

    const answers = new Map<string, Answer>()
    let terminated = 0
    let storming = true
    const terminator = (async () => {
      let answeredAtLast = 0
      while (storming) {
        await sleep(POLL_MS)
        if (answers.size - answeredAtLast < ANSWERS_PER_TERMINATION) continue
        const rows = await admin`SELECT pg_terminate_backend(pid) AS done FROM pg_stat_activity
          WHERE application_name = ${application} AND xact_start IS NOT NULL ORDER BY random() LIMIT 1`
        if (rows[0]?.done === true) {
          terminated++
          answeredAtLast = answers.size
        }
      }
    })()

    let next = 0
    const worker = async (): Promise<void> => {
      while (next < REQUESTS && deaths.length < MAX_DEATHS) {
        const key = `k${next++}`
        const instance = await current
        answers.set(key, await pay(instance.port, key, 100))
      }
    }
    const began = Date.now()
    await Promise.all(Array.from({ length: CONCURRENCY }, worker))
    const stormMs = Date.now() - began
    storming = false
    await terminator

    const counts = new Map<Outcome, number>()
    const byStatus = new Map<string, number>()
    for (const answer of answers.values()) {
      counts.set(answer.outcome, (counts.get(answer.outcome) ?? 0) + 1)
      const status = `${answer.status} ${answer.outcome}`
      byStatus.set(status, (byStatus.get(status) ?? 0) + 1)
    }
    t.comment(`${CLIENT_NAME}: ${answers.size} requests, ${terminated} backends terminated, ${deaths.length} process deaths in ${stormMs} ms; answers ${JSON.stringify(Object.fromEntries([...byStatus].sort()))}`)

    t.equal(deaths.length, 0, 'no process death: the driver never wrote on a connection that had closed, nor left a connection error unheard')
    t.equal(deaths.filter((stderr) => CRASH_SIGNATURE.test(stderr)).length, 0, `none with the signature of ${CRASH_NAME}`)
    t.equal(answers.size, REQUESTS, 'every request was sent to a live process')
    t.ok(terminated >= 50, `backends were terminated under open transactions (${terminated})`)
    t.ok(answers.size - (counts.get('committed') ?? 0) >= 10, 'requests were hit: some did not commit')
    t.ok((counts.get('committed') ?? 0) >= REQUESTS / 4, 'most requests still committed')

    // What the database holds after the storm, before any retry.
    const rows = async (): Promise<Map<string, number[]>> => {
      const byKey = new Map<string, number[]>()
      for (const row of await admin<Array<{ key: string, id: number }>>`SELECT key, id FROM ${admin(schema)}.payments ORDER BY id`) {
        byKey.set(row.key, [...(byKey.get(row.key) ?? []), row.id])
      }
      return byKey
    }
    const before = await rows()
    const wrong: string[] = []
    for (const [key, answer] of answers) {
      const ids = before.get(key) ?? []
      const fine = answer.outcome === 'committed'
        ? ids.length === 1 && ids[0] === answer.id
        : answer.outcome === 'outcome-unknown' || answer.outcome === 'lost' || answer.outcome === 'request-in-progress'
          ? ids.length <= 1
          : ids.length === 0
      if (!fine) wrong.push(`${key}: ${answer.outcome} (${answer.status}), rows ${JSON.stringify(ids)}`)
    }
    t.same(wrong, [], 'a 201 is exactly its committed row; a rollback (500, store-unavailable) left none; an unknown outcome at most one')

    // The client's retries, with the storm over: each key ends with exactly one execution.
    if (deaths.length >= MAX_DEATHS) current = start()
    const instance = await current
    const retried: string[] = []
    for (const [key, answer] of answers) {
      if (answer.outcome === 'committed') continue
      let final: Awaited<ReturnType<typeof pay>> | null = null
      for (let attempt = 0; attempt < 50 && final?.outcome !== 'committed'; attempt++) {
        if (attempt > 0) await sleep(50)
        final = await pay(instance.port, key, 100)
      }
      const ids = (await rows()).get(key) ?? []
      if (final?.outcome !== 'committed' || ids.length !== 1 || ids[0] !== final.id) {
        retried.push(`${key}: first ${answer.outcome}, retry ${final?.outcome ?? 'none'} ${String(final?.id)}, rows ${JSON.stringify(ids)}`)
      }
    }
    t.comment(`retries done in ${Date.now() - began - stormMs} ms`)
    t.same(retried, [], 'every retry got 201 with the one row of its key (replayed if the first attempt had committed)')

    const after = await rows()
    const twice = [...after].filter(([, ids]) => ids.length > 1).map(([key, ids]) => `${key}: ${ids.length} rows`)
    t.same(twice, [], 'no key executed twice')
    t.equal(after.size, answers.size, 'every key executed once')

    // A committed answer replays as it was.
    const sample = [...answers].find(([, answer]) => answer.outcome === 'committed')
    if (sample !== undefined) {
      const replay = await pay(instance.port, sample[0], 100)
      t.same([replay.outcome, replay.id, replay.replayed], ['committed', sample[1].id, true], 'a committed key replays its recorded answer')
    }

    let health: { openTransactions: number, one: number } | null = null
    for (let i = 0; i < 100; i++) {
      health = await (await fetch(`http://127.0.0.1:${instance.port}/health`)).json() as { openTransactions: number, one: number }
      if (health.openTransactions === 0) break
      await sleep(20)
    }
    t.same(health, { openTransactions: 0, one: 1 }, 'the surviving process holds no transaction and its pool still serves')
    stopping = true
  })
}
