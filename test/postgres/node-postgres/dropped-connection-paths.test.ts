import { spawn, type ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import t, { type Test } from 'tap'
import { startFaultProxy, type FaultProxy } from '../../helpers/fault-proxy.js'
import { postgresSchema } from '../../helpers/postgres-schema.js'
import { sleep } from '../../helpers/sleep.js'

/**
 * Atomic mode on node-postgres, each way a transaction's connection can die, one at a time (issue
 * 15: "a connection terminated under an open transaction ... must answer the affected requests
 * with the documented problem and leave the process serving"). node-postgres emits a client's
 * connection error as an 'error' event, on the checked-out client (which the store listens on) or,
 * for an idle one, on the pool (which the store listens on when the application does not); an
 * EventEmitter with no listener throws it and the process dies. So the app runs in a child process
 * (test/fixtures/node-postgres-dropped-connection-server.ts): a crash is a death this test counts,
 * not this test's own process dying.
 *
 * Each path checks: the process lives; the answer is the documented one (docs/drivers.md); the
 * rows say what committed; the pool holds no client whose connection died (its totalCount equals
 * the app's live backends) and the next request commits; the key is not stuck (a retry executes
 * once). test/postgres/dropped-connection.test.ts does the same at random, 1,000 times.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/node-postgres/dropped-connection-paths.test.ts` (it provisions a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

const FIXTURE = fileURLToPath(new URL('../../fixtures/node-postgres-dropped-connection-server.ts', import.meta.url))
const TYPE_BASE = 'tag:fastify-idempotency,2026:'

interface Answer {
  readonly status: number
  /** The problem type without its base, or null for another body (the handler's own error). */
  readonly type: string | null
  readonly replayed: boolean
  readonly body: Record<string, unknown>
}

interface State {
  readonly openTransactions: number
  readonly totalCount: number
  readonly idleCount: number
  readonly waitingCount: number
  readonly heldQueryable: boolean | null
  readonly failures: Array<{ message?: string, code?: string, severity?: string }>
  readonly backgroundErrors: Array<{ task: string, message: string }>
}

interface Instance {
  readonly name: string
  readonly child: ChildProcess
  readonly port: number
  /** The next stdout message carrying `field`. */
  next (field: string): Promise<Record<string, unknown>>
  stderr: string
  /** Set when the process exited: how, and the end of its stderr. */
  death: string | null
}

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const { name: schema, sql: admin, table: q } = postgresSchema(t, url, {
    prefix: 'idem_np_paths',
    client: { max: 4 },
    migrate: ['records'],
    setup: async ({ sql: admin, table: q }) => {
      // No unique constraint on key: a second execution shows up as a second row.
      await admin.unsafe(`CREATE TABLE ${q('payments')} (id serial PRIMARY KEY, key text NOT NULL)`)
      // Gates the test holds (SELECT … FOR UPDATE) to stop a statement at a chosen point: row 1 stops
      // the recorded response's UPDATE (complete()), row 2 the COMMIT (a deferred constraint trigger
      // runs at COMMIT). Only for keys named for it, so every other request runs freely.
      await admin.unsafe(`CREATE TABLE ${q('gate')} (id int PRIMARY KEY)`)
      await admin.unsafe(`INSERT INTO ${q('gate')} VALUES (1), (2)`)
      await admin.unsafe(`CREATE FUNCTION ${q('wait_for_gate')}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM 1 FROM ${q('gate')} WHERE id = TG_ARGV[0]::int FOR UPDATE; RETURN NEW; END $$`)
      await admin.unsafe(`CREATE TRIGGER complete_waits BEFORE UPDATE ON ${q('records')} FOR EACH ROW
        WHEN (NEW.key LIKE 'complete-%') EXECUTE FUNCTION ${q('wait_for_gate')}('1')`)
      await admin.unsafe(`CREATE CONSTRAINT TRIGGER commit_waits AFTER INSERT ON ${q('payments')} DEFERRABLE INITIALLY DEFERRED
        FOR EACH ROW WHEN (NEW.key LIKE 'commit-%') EXECUTE FUNCTION ${q('wait_for_gate')}('2')`)
      // A claim of a key listed here sleeps inside its INSERT: a statement in flight, for as long as
      // the test needs to end its connection.
      await admin.unsafe(`CREATE TABLE ${q('slow_claims')} (key text PRIMARY KEY)`)
      await admin.unsafe(`CREATE FUNCTION ${q('sleep_in_claim')}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN IF EXISTS (SELECT 1 FROM ${q('slow_claims')} WHERE key = NEW.key) THEN PERFORM pg_sleep(30); END IF; RETURN NEW; END $$`)
      await admin.unsafe(`CREATE TRIGGER claim_sleeps BEFORE INSERT ON ${q('records')} FOR EACH ROW EXECUTE FUNCTION ${q('sleep_in_claim')}()`)
    }
  })

  const children = new Set<ChildProcess>()
  t.teardown(() => { for (const child of children) child.kill('SIGKILL') })

  /** A fresh app process per path, so that one path's death cannot hide in another's. */
  async function start (t: Test, path: string, databaseUrl = url, env: Record<string, string> = {}): Promise<Instance> {
    const name = `idem-np-${path}-${id}`
    const child = spawn(process.execPath, ['--import', 'tsx', FIXTURE], {
      env: { ...process.env, DATABASE_URL: databaseUrl, IDEM_SCHEMA: schema, IDEM_APP: name, ...env },
      stdio: ['ignore', 'pipe', 'pipe']
    })
    children.add(child)
    const messages: Array<Record<string, unknown>> = []
    let wake: (() => void) | null = null
    createInterface({ input: child.stdout as NodeJS.ReadableStream }).on('line', (line) => {
      try { messages.push(JSON.parse(line) as Record<string, unknown>) } catch { return }
      wake?.()
    })
    const instance: Instance = {
      name,
      child,
      port: 0,
      stderr: '',
      death: null,
      async next (field) {
        for (let waited = 0; waited < 15_000; waited += 50) {
          const index = messages.findIndex((message) => field in message)
          if (index >= 0) return messages.splice(index, 1)[0] as Record<string, unknown>
          if (instance.death !== null) break
          await new Promise<void>((resolve) => { wake = resolve; setTimeout(resolve, 50) })
        }
        throw new Error(`the app (${path}) did not report ${field}${instance.death === null ? '' : `: it died, ${instance.death}`}`)
      }
    }
    child.stderr?.on('data', (chunk: Buffer) => { instance.stderr = (instance.stderr + chunk.toString()).slice(-4_000) })
    let stopping = false
    child.once('exit', (code, signal) => {
      children.delete(child)
      if (stopping) return
      instance.death = `${signal ?? String(code)}: ${instance.stderr.slice(-1_500)}`
      t.comment(`the app process (${path}) died (${signal ?? String(code)}): ${instance.stderr.slice(-1_500)}`)
    })
    t.teardown(() => { stopping = true; child.kill('SIGKILL') })
    const { port } = await instance.next('port')
    return Object.assign(instance, { port: port as number })
  }

  async function pay (app: Instance, key: string, mode?: string): Promise<Answer> {
    let response: Response
    try {
      response = await fetch(`http://127.0.0.1:${app.port}/pay`, {
        method: 'POST',
        headers: { 'idempotency-key': `"${key}"`, ...(mode === undefined ? {} : { 'x-mode': mode }) }
      })
    } catch {
      // No answer: the process is gone (counted by `alive`).
      return { status: 0, type: null, replayed: false, body: {} }
    }
    const body = JSON.parse(await response.text()) as Record<string, unknown>
    const type = typeof body.type === 'string' && body.type.startsWith(TYPE_BASE) ? body.type.slice(TYPE_BASE.length) : null
    return { status: response.status, type, replayed: response.headers.get('idempotent-replayed') === 'true', body }
  }

  async function state (app: Instance): Promise<State> {
    try {
      return await (await fetch(`http://127.0.0.1:${app.port}/state`)).json() as State
    } catch (err) {
      for (let i = 0; i < 100 && app.death === null; i++) await sleep(10)
      throw new Error(`the app did not answer: ${app.death === null ? String(err) : `it died, ${app.death}`}`)
    }
  }
  const resume = async (app: Instance): Promise<void> => { await fetch(`http://127.0.0.1:${app.port}/resume`, { method: 'POST' }) }
  const rowsOf = async (key: string): Promise<number[]> =>
    (await admin.unsafe(`SELECT id FROM ${q('payments')} WHERE key = $1 ORDER BY id`, [key])).map((row) => row.id as number)

  interface Backend { readonly pid: number, readonly state: string | null, readonly wait_event_type: string | null, readonly query: string }
  const backends = async (app: Instance): Promise<Backend[]> =>
    await admin<Backend[]>`SELECT pid, state, wait_event_type, query FROM pg_stat_activity WHERE application_name = ${app.name}`

  /** The pid of the app's backend that matches, once one does. */
  async function backendWhere (app: Instance, what: string, match: (backend: Backend) => boolean): Promise<number> {
    for (let i = 0; i < 500; i++) {
      const found = (await backends(app)).find(match)
      if (found !== undefined) return found.pid
      await sleep(10)
    }
    throw new Error(`no backend of ${app.name} ${what}`)
  }

  async function terminate (t: Test, pid: number): Promise<void> {
    const [row] = await admin`SELECT pg_terminate_backend(${pid}) AS done`
    t.equal(row?.done, true, `backend ${pid} terminated`)
  }

  /** Until node-postgres has emitted the held client's connection error (the event that kills a process nobody listens on). */
  async function heldClientErrored (t: Test, app: Instance): Promise<void> {
    let queryable: boolean | null = true
    for (let i = 0; i < 500 && queryable !== false && app.death === null; i++) {
      queryable = (await state(app)).heldQueryable
      if (queryable !== false) await sleep(10)
    }
    t.equal(queryable, false, "node-postgres emitted the held client's connection error while the handler waited")
  }

  /** A transaction of the test's own that runs `statement` (a gate row FOR UPDATE, a table lock) and keeps its locks until released. */
  async function holdGate (statement: string): Promise<{ release (): Promise<void> }> {
    let release!: () => void
    const released = new Promise<void>((resolve) => { release = resolve })
    let locked!: () => void
    const holding = new Promise<void>((resolve) => { locked = resolve })
    const done = admin.begin(async (tx) => {
      await tx.unsafe(statement)
      locked()
      await released
    })
    await holding
    return { release: async () => { release(); await done } }
  }

  /**
   * What every path ends with: the process lived; the pool holds no client whose connection died
   * (its totalCount comes back to the app's live backends: the dead client was destroyed, not
   * returned for reuse); a fresh request commits; the dropped request's key is not stuck (its
   * retry commits, with exactly one row: `replay` when the dropped attempt had committed after all).
   */
  async function afterwards (t: Test, app: Instance, key: string, dead: number, replay = false): Promise<void> {
    let current = await state(app)
    let live = (await backends(app)).length
    for (let i = 0; i < 200 && (current.openTransactions !== 0 || current.totalCount !== live); i++) {
      await sleep(10)
      current = await state(app)
      live = (await backends(app)).length
    }
    t.equal(current.openTransactions, 0, 'no transaction left open')
    t.equal(current.totalCount, live, `the pool holds only live connections (${current.totalCount} clients, ${live} backends)`)
    t.notOk((await backends(app)).some((backend) => backend.pid === dead), 'the dropped backend is gone')

    const fresh = await pay(app, `${key}-next`)
    t.equal(fresh.status, 201, 'the process serves the next request, which commits')
    t.not(fresh.body.pid, dead, 'on another connection')
    t.same(await rowsOf(`${key}-next`), [fresh.body.id], 'its one row')

    const retry = await pay(app, key)
    t.same([retry.status, retry.replayed], [201, replay], replay ? 'the retry replays the committed answer' : 'the retry executes')
    t.same(await rowsOf(key), [retry.body.id], 'the key executed exactly once')
    t.equal(app.death, null, 'the process never died')
  }

  /** Claims of `key` sleep in their INSERT until `release()`. */
  async function slowClaims (key: string): Promise<{ release (): Promise<void> }> {
    await admin.unsafe(`INSERT INTO ${q('slow_claims')} (key) VALUES ($1)`, [key])
    return { release: async () => { await admin.unsafe(`DELETE FROM ${q('slow_claims')} WHERE key = $1`, [key]) } }
  }
  const sleepingInClaim = (backend: Backend): boolean => backend.wait_event_type === 'Timeout' && /INSERT/i.test(backend.query)

  t.test('(a) terminated during the claim (its statement in flight): 503 store-unavailable, nothing committed', async (t) => {
    const app = await start(t, 'claim')
    const slow = await slowClaims('claim')
    const answer = pay(app, 'claim')
    const pid = await backendWhere(app, 'sleeping in its claim', sleepingInClaim)
    await terminate(t, pid)
    const response = await answer
    await slow.release()
    t.same([response.status, response.type], [503, 'store-unavailable'], 'the claim could not be made')
    t.same(await rowsOf('claim'), [], 'the handler never ran')
    await afterwards(t, app, 'claim', pid)
  })

  t.test('the terminated connection is not handed on: with one connection in the pool, the request waiting for it gets a fresh one', async (t) => {
    // The claim's statement fails with the server's FATAL before node-postgres has read the end of
    // the socket (so the client still looks queryable), and the pool hands a released client to
    // the first request in its queue at once: only release(err) keeps the dead one from it.
    const app = await start(t, 'handed-on', url, { IDEM_POOL_MAX: '1' })
    const slow = await slowClaims('handed-on')
    const first = pay(app, 'handed-on')
    const pid = await backendWhere(app, 'sleeping in its claim', sleepingInClaim)
    const second = pay(app, 'handed-on-waiting')
    let waiting = 0
    for (let i = 0; i < 500 && waiting === 0; i++) {
      waiting = (await state(app)).waitingCount
      if (waiting === 0) await sleep(10)
    }
    t.equal(waiting, 1, 'a second request waits for the pool\'s only connection')
    await terminate(t, pid)
    await slow.release()
    const [dropped, next] = await Promise.all([first, second])
    t.same([dropped.status, dropped.type], [503, 'store-unavailable'], 'the dropped claim')
    t.same([next.status, next.type], [201, null], 'the waiting request commits')
    t.not(next.body.pid, pid, 'on a new connection')
    t.same(await rowsOf('handed-on-waiting'), [next.body.id])
    await afterwards(t, app, 'handed-on', pid)
  })

  t.test("(b) terminated while the handler runs, no query in flight (the held client emits 'error'): 500 not-committed", async (t) => {
    const app = await start(t, 'handler-idle')
    const answer = pay(app, 'handler-idle', 'hold')
    const { pid } = await app.next('held') as { pid: number }
    await terminate(t, pid)
    await heldClientErrored(t, app)
    await resume(app)
    const response = await answer
    t.same([response.status, response.type], [500, 'not-committed'], 'the handler returned, but nothing could be committed')
    t.same(await rowsOf('handler-idle'), [], 'its write was rolled back with the connection')
    await afterwards(t, app, 'handler-idle', pid)
  })

  t.test('(b) the same, and the handler queries again: refused with CONNECTION_CLOSED, not sent; the handler\'s error (500)', async (t) => {
    const app = await start(t, 'handler-query')
    const answer = pay(app, 'handler-query', 'hold-query')
    const { pid } = await app.next('held') as { pid: number }
    await terminate(t, pid)
    await heldClientErrored(t, app)
    await resume(app)
    const response = await answer
    t.same([response.status, response.type], [500, null], "the handler's own error: rolled back (docs/drivers.md)")
    const { failures } = await state(app)
    t.equal(failures[0]?.code, 'CONNECTION_CLOSED', 'the code postgres.js gives a closed connection, one code for both clients')
    t.match(failures[0]?.message, /connection of this request's transaction closed/, 'refused by the guard, not sent')
    t.same(await rowsOf('handler-query'), [], 'nothing committed')
    await afterwards(t, app, 'handler-query', pid)
  })

  t.test("(c) terminated during the handler's own query: it fails, the query sent in reaction is refused; the handler's error (500)", async (t) => {
    const app = await start(t, 'handler-query-in-flight')
    const answer = pay(app, 'in-flight', 'sleep')
    const { pid } = await app.next('sleeping') as { pid: number }
    await backendWhere(app, 'in pg_sleep', (backend) => backend.pid === pid && backend.state === 'active' && backend.query.includes('pg_sleep'))
    await terminate(t, pid)
    const response = await answer
    t.same([response.status, response.type], [500, null], "the handler's own error: rolled back")
    const { failures } = await state(app)
    t.equal(failures.length, 2, 'the query in flight failed, then the one sent in reaction')
    t.comment(`the query in flight failed with ${JSON.stringify(failures[0])}`)
    t.equal(failures[1]?.code, 'CONNECTION_CLOSED')
    t.match(failures[1]?.message, /connection of this request's transaction closed/, 'refused by the guard, not sent')
    t.same(await rowsOf('in-flight'), [], 'nothing committed')
    await afterwards(t, app, 'in-flight', pid)
  })

  t.test('(d) terminated while complete() is blocked on a row lock: 500 not-committed', async (t) => {
    const app = await start(t, 'complete')
    const gate = await holdGate(`SELECT 1 FROM ${q('gate')} WHERE id = 1 FOR UPDATE`)
    const answer = pay(app, 'complete-1')
    const pid = await backendWhere(app, 'recording its response', (backend) => backend.wait_event_type === 'Lock' && /UPDATE/i.test(backend.query))
    await terminate(t, pid)
    const response = await answer
    await gate.release()
    t.same([response.status, response.type], [500, 'not-committed'], 'the response could not be recorded: rolled back, and said so')
    t.same(await rowsOf('complete-1'), [], 'nothing committed')
    await afterwards(t, app, 'complete-1', pid)
  })

  t.test('(e) terminated during COMMIT (a deferred trigger blocked on a lock): the server reports the abort, 500 not-committed', async (t) => {
    const app = await start(t, 'commit')
    const gate = await holdGate(`SELECT 1 FROM ${q('gate')} WHERE id = 2 FOR UPDATE`)
    const answer = pay(app, 'commit-1')
    const pid = await backendWhere(app, 'in COMMIT', (backend) => backend.wait_event_type === 'Lock' && backend.query === 'COMMIT')
    await terminate(t, pid)
    const response = await answer
    await gate.release()
    // A difference between the clients. node-postgres hands the COMMIT the server's own answer,
    // FATAL 57P01 (a server error: transaction.ts, commitError, takes it for a rollback): the
    // backend died before its commit record, as it holds interrupts from just before that record to
    // the end of the commit, so not-committed is what happened. postgres.js 3.4.9, in this same
    // scenario, rejects the COMMIT with a connection error, not the server's FATAL, and the client
    // gets 503 outcome-unknown: true too, only less precise. Nothing committed either way. A COMMIT whose
    // connection just vanished, with no word from the server, is unknown on both: (f) below.
    t.same([response.status, response.type], [500, 'not-committed'], 'COMMIT failed with the server saying so')
    t.same(await rowsOf('commit-1'), [], 'nothing committed')
    await afterwards(t, app, 'commit-1', pid)
  })

  t.test('(f) TCP reset through a proxy', async (t) => {
    const target = new URL(url)
    let proxy: FaultProxy | null = null
    t.before(async () => { proxy = await startFaultProxy({ host: target.hostname, port: Number(target.port || 5432) }) })
    t.teardown(async () => { await proxy?.close() })
    const proxied = (): string => { const through = new URL(url); through.hostname = '127.0.0.1'; through.port = String(proxy?.port); return through.toString() }

    t.test('while the handler runs, no query in flight (ECONNRESET on the held client): 500 not-committed', async (t) => {
      const app = await start(t, 'reset-handler', proxied())
      const answer = pay(app, 'reset-handler', 'hold')
      const { pid } = await app.next('held') as { pid: number }
      proxy?.resetConnections()
      await heldClientErrored(t, app)
      await resume(app)
      const response = await answer
      t.same([response.status, response.type], [500, 'not-committed'])
      t.same(await rowsOf('reset-handler'), [], 'nothing committed')
      await afterwards(t, app, 'reset-handler', pid)
    })

    t.test('during COMMIT: 503 outcome-unknown, and it was unknown: the backend, unaware, commits once the lock frees; the retry replays it', async (t) => {
      const app = await start(t, 'reset-commit', proxied())
      const gate = await holdGate(`SELECT 1 FROM ${q('gate')} WHERE id = 2 FOR UPDATE`)
      const answer = pay(app, 'commit-reset')
      const pid = await backendWhere(app, 'in COMMIT', (backend) => backend.wait_event_type === 'Lock' && backend.query === 'COMMIT')
      proxy?.resetConnections()
      const response = await answer
      t.same([response.status, response.type], [503, 'outcome-unknown'], 'COMMIT was sent and its answer never came')
      // The backend is blocked in the trigger and reads nothing from its socket: the reset reaches it
      // only when it writes COMMIT's answer, after committing.
      t.ok((await backends(app)).some((backend) => backend.pid === pid), 'the backend is still running the COMMIT')
      await gate.release()
      for (let i = 0; i < 200 && (await backends(app)).some((backend) => backend.pid === pid); i++) await sleep(10)
      t.equal((await rowsOf('commit-reset')).length, 1, 'the transaction committed after all')
      await afterwards(t, app, 'commit-reset', pid, true)
    })
  })

  t.test("an idle pooled client terminated: the pool's 'error' goes to onBackgroundError, the pool drops it and serves", async (t) => {
    const app = await start(t, 'idle')
    const first = await pay(app, 'idle-first')
    t.equal(first.status, 201)
    // The route waits, so the answer's settlement notice follows it on a pooled client: until it is back.
    let before = await state(app)
    for (let i = 0; i < 200 && before.idleCount === 0; i++) {
      await sleep(10)
      before = await state(app)
    }
    t.ok(before.idleCount >= 1, `the pool keeps idle clients (${before.idleCount})`)
    const idle = (await backends(app)).filter((backend) => backend.state === 'idle')
    for (const backend of idle) await terminate(t, backend.pid)
    let after = await state(app)
    for (let i = 0; i < 200 && after.totalCount > before.totalCount - idle.length; i++) {
      await sleep(10)
      after = await state(app)
    }
    t.equal(after.totalCount, before.totalCount - idle.length, 'the pool removed the dead clients')
    t.ok(after.backgroundErrors.length >= idle.length && after.backgroundErrors.every((error) => error.task === 'connection'),
      `each reached onBackgroundError as task 'connection' (${JSON.stringify(after.backgroundErrors)})`)
    await afterwards(t, app, 'idle-first', idle[0]?.pid ?? 0, true)
  })
}
