import { execFile, type ChildProcess } from 'node:child_process'
import { createHash, randomBytes, randomUUID } from 'node:crypto'
import { readFile } from 'node:fs/promises'
import { createServer, connect, type AddressInfo, type Server, type Socket } from 'node:net'
import { fileURLToPath } from 'node:url'
import { promisify } from 'node:util'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import pg from 'pg'
import postgres from 'postgres'
import t, { type Test } from 'tap'
import idempotency, { InvalidOptionError, type IdempotencyOptions } from '../../lib/index.js'
import type { ClaimResult, Fingerprint, IdempotencyStore, StoredResponse } from '../../lib/core/store.js'
import { migrate, postgresStore, type PostgresClient, type PostgresStore, type PostgresStoreOptions } from '../../drivers/postgres/index.js'
import { runConformance } from '../../conformance/index.js'
import { deferred } from '../helpers/app.js'
import { spawnFixture, type ChildApp } from '../helpers/child-app.js'
import { lockWaitProbe } from '../helpers/lock-waits.js'
import { CLIENT_NAME, clientUnderTest, endPools, poolLike, storeConnection } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The Postgres driver against a real server (DATABASE_URL; `node scripts/test.mjs` provisions a
 * throwaway one). Everything lives in a random schema of its own, dropped at the end; each test
 * uses its own table in it.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: the Postgres driver tests need a real PostgreSQL server. ' +
    'Run `node scripts/test.mjs test/postgres/postgres.test.ts` (it starts a throwaway server and sets DATABASE_URL), ' +
    'or set DATABASE_URL=postgres://… to a database where the tests may create and drop schemas.')
} else {
  suite(DATABASE_URL)
}

const FIXTURE = fileURLToPath(new URL('../fixtures/postgres-server.ts', import.meta.url))
const LONG = 60_000
const fp = (text: string, algorithm = 'canonical-v1'): Fingerprint => ({ algorithm, digest: createHash('sha256').update(text).digest() })
const A = fp('request A')
const response = (text: string): StoredResponse => ({ statusCode: 201, headers: { 'content-type': 'application/json' }, body: Buffer.from(text) })
const execFileAsync = promisify(execFile)
/** The path of an executable on PATH, or null. */
const which = (name: string): Promise<string | null> =>
  execFileAsync('sh', ['-c', `command -v ${name}`]).then(({ stdout }) => stdout.trim() || null, () => null)
// postgres.js sends a query without parameters through the simple protocol unless told
// `simple: false` (an option its types do not declare); the extended protocol prepares it.
const EXTENDED = { simple: false } as unknown as postgres.UnsafeQueryOptions
const keyed = (key: string): Record<string, string> => ({ 'idempotency-key': `"${key}"`, 'content-type': 'application/json' })

/** Waits (bounded) until `check` resolves truthy; fails the test instead of hanging. */
async function until (t: Test, what: string, check: () => Promise<boolean> | boolean, limitMs = 5000): Promise<boolean> {
  const deadline = Date.now() + limitMs
  for (;;) {
    if (await check()) return true
    if (Date.now() > deadline) {
      t.fail(`timed out waiting for ${what}`)
      return false
    }
    await sleep(10)
  }
}

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const { name: schema, sql } = postgresSchema(t, url, {
    prefix: 'idem',
    client: { max: 10, connection: { application_name: `idem-test-${id}` } },
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.executions (key text NOT NULL, pid integer NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`
  })
  const extraSchemas = [`${schema}_migrated`, `${schema}_plain`, `${schema}_concurrent`, `${schema}_split`]
  const clients: PostgresClient[] = []
  const children = new Set<ChildProcess>()

  /** A client of the test's own; `name` becomes its application_name, so its backends can be found. */
  function client (name: string, options: postgres.Options<Record<string, postgres.PostgresType>> = {}): PostgresClient {
    const sql = postgres(url, { max: 10, onnotice: () => {}, ...options, connection: { application_name: `${name}-${id}`, ...options.connection } })
    clients.push(sql)
    return sql
  }

  // Whether a client's statement is blocked on a lock, on plain PostgreSQL or on Citus (where the
  // wait is on a worker): test/helpers/lock-waits.ts.
  let waitingOnLock: (applicationName: string) => Promise<boolean> = async () => { throw new Error('t.before has not run') }

  t.before(async () => {
    waitingOnLock = await lockWaitProbe(sql)
  })

  t.teardown(async () => {
    for (const child of children) child.kill('SIGKILL')
    for (const name of extraSchemas) await sql`DROP SCHEMA IF EXISTS ${sql(name)} CASCADE`
    // Bounded: in postgres.js 3.4.9, end() never resolves on its own once a connection died
    // mid-query (porsager/postgres#1097), which the pg_terminate_backend test does on purpose.
    await Promise.all(clients.map((c) => c.end({ timeout: 1 })))
    await endPools()
  })

  /** A migrated store on its own table of the test schema. */
  async function storeOn (table: string, options: Partial<PostgresStoreOptions> = {}): Promise<PostgresStore> {
    const store = postgresStore({ ...storeConnection(sql), schema, table, purgeInterval: 0, ...options })
    await store.migrate()
    return store
  }

  async function app (t: Test, store: IdempotencyStore, options: IdempotencyOptions = {}, handler?: (key: string) => Promise<unknown>): Promise<{ app: FastifyInstance, executions: () => number }> {
    const instance = Fastify()
    t.teardown(() => instance.close())
    await instance.register(idempotency, { store, scope: () => 'test', ...options })
    let executions = 0
    instance.post('/pay', async (request, reply) => {
      executions++
      const key = request.idempotency?.key ?? ''
      await sql`INSERT INTO ${sql(schema)}.executions (key, pid) VALUES (${key}, ${process.pid})`
      if (handler !== undefined) await handler(key)
      reply.code(201)
      return { pid: process.pid, execution: executions, charge: randomUUID() }
    })
    return { app: instance, executions: () => executions }
  }

  const pay = (instance: FastifyInstance, key: string): Promise<LightMyRequestResponse> =>
    instance.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: { amount: 100 } })

  async function rows (table: string, key: string): Promise<Array<{ state: string }>> {
    return sql<Array<{ state: string }>>`SELECT state FROM ${sql(schema)}.${sql(table)} WHERE scope = 'test' AND key = ${key}`
  }

  async function executionsOf (key: string): Promise<number[]> {
    const found = await sql<Array<{ pid: number }>>`SELECT pid FROM ${sql(schema)}.executions WHERE key = ${key} ORDER BY at`
    return found.map((row) => row.pid)
  }

  /** Starts the fixture app in a child process; resolves with its port and a stream of its stdout messages. */
  async function spawnInstance (t: Test, env: Record<string, string>): Promise<ChildApp> {
    const instance = await spawnFixture(t, FIXTURE, { DATABASE_URL: url, IDEM_SCHEMA: schema, ...env })
    children.add(instance.child)
    instance.child.on('exit', () => children.delete(instance.child))
    return instance
  }

  t.test('options are validated once, naming the option and the value', async (t) => {
    const bad: Array<[Record<string, unknown>, RegExp]> = [
      [{}, /option "sql" or "pool" must be a postgres \(porsager\) client as \{ sql \}, or a node-postgres Pool as \{ pool \}; received undefined/],
      [{ sql: {} }, /option "sql"/],
      [{ sql, schema: '' }, /option "schema" must be a non-empty identifier.*received a string of 0 characters/],
      [{ sql, schema: 'a.b' }, /option "schema".*without dots.*received a string of 3 characters/],
      [{ sql, table: 'x'.repeat(64) }, /option "table" must be a non-empty identifier of at most 63 bytes/],
      [{ sql, table: 5 }, /option "table".*received 5/],
      [{ sql, purgeInterval: -1 }, /option "purgeInterval" must be an integer from 0 to 2147483647; received -1/],
      [{ sql, purgeInterval: 1.5 }, /purgeInterval.*received 1\.5/],
      [{ sql, purgeBatch: 0 }, /option "purgeBatch" must be an integer from 1.*received 0/],
      [{ pool: {} }, /option "pool" must be a node-postgres Pool/],
      [{ pool: sql }, /option "pool" must be a node-postgres Pool/],
      [{ sql, pool: poolLike(sql) }, /either \{ sql \} \(postgres\.js\) or \{ pool \} \(node-postgres\), not both/],
      [{ pool: new pg.Client({ connectionString: url }) }, /not a Client or PoolClient/]
    ]
    for (const [options, message] of bad) {
      t.throws(() => postgresStore(options as unknown as PostgresStoreOptions), message, JSON.stringify(Object.keys(options)))
      try { postgresStore(options as unknown as PostgresStoreOptions) } catch (err) { t.type(err, InvalidOptionError) }
    }
    await t.rejects(migrate(sql, { table: 'a.b' }), InvalidOptionError)
    await t.rejects(migrate({} as never), /migrate: client must be a postgres \(porsager\) client.*or a node-postgres Pool/)
    const store = postgresStore({ ...storeConnection(sql), schema, purgeInterval: 10 })
    await t.rejects(store.purgeExpired(-1), /non-negative integer/)
    await store.close()
    t.same([...await sql`SELECT 1 AS one`], [{ one: 1 }], 'close() leaves the client open')
  })

  t.test(`conformance (${CLIENT_NAME})`, async (t) => {
    runConformance({ test: (name, fn) => t.test(name, fn), makeStore: () => storeOn('conformance') })
  })

  t.test('migrate: creates the schema, runs twice and concurrently; schema.sql, applied statement by statement as its header says, yields the same tables', async (t) => {
    const [migrated, plain, concurrent, split] = extraSchemas as [string, string, string, string]
    await migrate(clientUnderTest(sql), { schema: migrated })
    await migrate(clientUnderTest(sql), { schema: migrated })
    await Promise.all(Array.from({ length: 5 }, () => migrate(clientUnderTest(sql), { schema: concurrent, table: 'records' })))
    t.pass('migrate ran twice, and five times at once')

    const file = fileURLToPath(new URL('../../drivers/postgres/schema.sql', import.meta.url))
    const text = await readFile(file, 'utf8')
    // Why not as one text: a statement that comes in a text of several commands is refused where it
    // has to be prepared, which is what a Citus worker does with the DDL it is forwarded from such
    // a text. The extended protocol (Parse) refuses it the same way here.
    await t.rejects(sql.unsafe(text, [], EXTENDED), /cannot insert multiple commands into a prepared statement/,
      'the whole file is several commands: a worker would refuse it')

    // 1. psql -f, twice: psql sends each statement by itself.
    const psql = await which('psql')
    if (psql === null) {
      t.fail('psql is not installed: the test services come with it (Debian\'s postgresql package)')
    } else {
      for (let i = 0; i < 2; i++) {
        await sql`CREATE SCHEMA IF NOT EXISTS ${sql(plain)}`
        const run = await execFileAsync(psql, [url, '-X', '-q', '-v', 'ON_ERROR_STOP=1', '-f', file], {
          env: { ...process.env, PGOPTIONS: `-c search_path=${plain} -c client_min_messages=warning` }
        }).then(() => null, (err: Error & { stderr?: string }) => err.stderr ?? err.message)
        t.equal(run, null, `psql -f schema.sql, run ${i + 1}: no error`)
      }
    }

    // 2. Split at every semicolon, each piece sent alone through the extended protocol (so a piece
    //    of more than one command would be refused, as on a Citus worker), twice.
    const pieces = text.split(';').filter((piece) => piece.trim() !== '')
    await sql`CREATE SCHEMA ${sql(split)}`
    for (let i = 0; i < 2; i++) {
      await sql.begin(async (tx) => {
        await tx`SET LOCAL search_path TO ${tx(split)}`.simple()
        await tx`SET LOCAL client_min_messages = warning`.simple()
        for (const piece of pieces) {
          const result = await tx.unsafe(piece, [], EXTENDED)
          // A piece without a command would be a semicolon in a comment: a splitter that does not
          // parse comments would, elsewhere, cut a comment in two and send half of it as SQL.
          t.ok(result.command, `one statement per piece: ${JSON.stringify(piece.replace(/--.*$/gm, '').trim().slice(0, 60))}`)
        }
      })
    }
    t.pass('schema.sql split at every semicolon, applied twice')

    const describe = async (name: string, table: string): Promise<unknown> => ({
      columns: [...await sql`
        SELECT column_name, ordinal_position, data_type, is_nullable, column_default, collation_name
        FROM information_schema.columns WHERE table_schema = ${name} AND table_name = ${table}
        ORDER BY ordinal_position`],
      indexes: (await sql<Array<{ def: string }>>`
        SELECT indexname || ': ' || indexdef AS def FROM pg_indexes
        WHERE schemaname = ${name} AND tablename = ${table} ORDER BY indexname`).map((row) => row.def.replaceAll(name, 'S')),
      constraints: [...await sql`
        SELECT contype, pg_get_constraintdef(oid) AS def FROM pg_constraint
        WHERE conrelid = ${`"${name}".${table}`}::regclass ORDER BY contype, def`]
    })
    for (const table of ['idempotency_records', 'idempotency_records_outbox']) {
      const fromMigrate = await describe(migrated, table)
      if (psql !== null) t.same(await describe(plain, table), fromMigrate, `${table}, psql -f: same columns, types, defaults, collations, indexes and constraints`)
      t.same(await describe(split, table), fromMigrate, `${table}, split: same columns, types, defaults, collations, indexes and constraints`)
      t.equal((fromMigrate as { columns: unknown[] }).columns.length, table === 'idempotency_records' ? 14 : 11)
    }

    const store = postgresStore({ ...storeConnection(sql), schema: split, purgeInterval: 0 })
    const claim = await store.claim({ scope: 's', key: 'k', fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    t.equal(claim.outcome, 'acquired', 'the store works on the table schema.sql made')
    await store.close()
  })

  t.test('migrate on an up-to-date schema locks no table: it returns while a transaction is open on the records table, and claims never queue behind it', async (t) => {
    const [migrated] = extraSchemas as [string]
    await migrate(clientUnderTest(sql), { schema: migrated })
    // An atomic-mode request in flight: its transaction holds ROW EXCLUSIVE on the table until its
    // handler ends. A no-op ALTER TABLE or CREATE INDEX would wait for it (and every claim after
    // them would queue behind their lock).
    let endHolder!: () => void
    const holding = new Promise<void>((resolve) => { endHolder = resolve })
    let locked!: () => void
    const lockTaken = new Promise<void>((resolve) => { locked = resolve })
    const holder = sql.begin(async (tx) => {
      await tx`INSERT INTO ${tx(migrated)}.idempotency_records (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, lease_expires_at, expires_at)
        VALUES ('s', 'held', '\\x00', 'x', 'in_progress', ${randomUUID()}, now() + interval '1 minute', now() + interval '1 day')`
      locked()
      await holding
    })
    t.teardown(() => { endHolder() })
    await lockTaken
    const outcome = await Promise.race([
      migrate(clientUnderTest(sql), { schema: migrated }).then(() => 'returned'),
      sleep(5000).then(() => 'blocked behind the open transaction')
    ])
    t.equal(outcome, 'returned', 'migrate() sent no DDL that waits for the transactions in flight')
    const store = postgresStore({ ...storeConnection(sql), schema: migrated, purgeInterval: 0 })
    const claim = await Promise.race([
      Promise.resolve(store.claim({ scope: 's', key: 'after-migrate', fingerprint: A, leaseMs: LONG, ttlMs: LONG })).then((c) => c.outcome),
      sleep(5000).then(() => 'queued behind a lock')
    ])
    t.equal(claim, 'acquired', 'a claim right after it is answered')
    endHolder()
    await holder
    await store.close()
  })

  t.test('fresh-key claim and complete are one round trip each', async (t) => {
    // A TCP proxy counts round trips: the client's turns to write, each after the server answered
    // (postgres.js sends Bind/Execute/Sync in one write; node-postgres may send them as several).
    let writes = 0
    let serverSpoke = true
    const target = new URL(url)
    const proxy: Server = createServer((socket: Socket) => {
      const upstream = connect(Number(target.port || 5432), target.hostname)
      socket.on('data', (chunk) => { if (serverSpoke) writes++; serverSpoke = false; upstream.write(chunk) })
      upstream.on('data', (chunk) => { serverSpoke = true; socket.write(chunk) })
      socket.on('close', () => upstream.destroy())
      upstream.on('close', () => socket.destroy())
      socket.on('error', () => upstream.destroy())
      upstream.on('error', () => socket.destroy())
    })
    await new Promise<void>((resolve) => proxy.listen(0, '127.0.0.1', resolve))
    t.teardown(() => new Promise<void>((resolve) => proxy.close(() => resolve())))
    const proxied = new URL(url)
    proxied.hostname = '127.0.0.1'
    proxied.port = String((proxy.address() as AddressInfo).port)
    const through = postgres(proxied.toString(), { max: 1, onnotice: () => {} })
    t.teardown(() => through.end({ timeout: 1 }))
    await storeOn('roundtrip')
    const store = postgresStore({ ...storeConnection(through), schema, table: 'roundtrip', purgeInterval: 0 })
    // Warm up: the first use of each statement on a connection also prepares it (Parse/Describe).
    const warm = await store.claim({ scope: 's', key: 'warm', fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    if (warm.outcome === 'acquired') await store.complete(warm.lease, response('warm'), LONG)

    writes = 0
    serverSpoke = true
    const claim = await store.claim({ scope: 's', key: `fresh-${randomUUID()}`, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    t.equal(writes, 1, 'claim of a fresh key: one round trip')
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    writes = 0
    serverSpoke = true
    t.ok(await store.complete(claim.lease, response('done'), LONG))
    t.equal(writes, 1, 'complete: one round trip')
    writes = 0
    serverSpoke = true
    t.equal((await store.claim({ scope: 's', key: claim.lease.key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })).outcome, 'completed')
    t.equal(writes, 1, 'claim of a completed key (replay): one round trip')
    await store.close()
  })

  t.test('50 simultaneous first requests through the plugin: one execution', async (t) => {
    const store = await storeOn('plugin')
    t.teardown(() => store.close())

    // The original holds its lease until the 49 others are answered (bounded, so a regression fails
    // instead of hanging): a fixed sleep let a claim that queued for a pool connection on a loaded
    // machine arrive after completion and get a replay, which is right but not what this checks.
    let refusals = 0
    const allRefused = deferred()
    const bound = setTimeout(allRefused.resolve, 10_000)
    t.teardown(() => clearTimeout(bound))
    const refused = await app(t, store, {}, () => allRefused.promise)
    const key = `k-${randomUUID()}`
    const results = await Promise.all(Array.from({ length: 50 }, () => pay(refused.app, key).then((r) => {
      if (r.statusCode === 409 && ++refusals === 49) allRefused.resolve()
      return r
    })))
    t.equal(refused.executions(), 1, 'the handler ran once')
    t.equal(results.filter((r) => r.statusCode === 201).length, 1, 'one 201')
    t.equal(results.filter((r) => r.statusCode === 409).length, 49, 'the others 409')
    t.same(await rows('plugin', key), [{ state: 'completed' }], 'one completed row')

    const waiting = await app(t, store, { wait: 3000 }, () => sleep(100))
    const key2 = `k-${randomUUID()}`
    const replies = await Promise.all(Array.from({ length: 50 }, () => pay(waiting.app, key2)))
    t.equal(waiting.executions(), 1, 'with wait: the handler ran once')
    t.ok(replies.every((r) => r.statusCode === 201), 'with wait: all 50 got 201')
    t.equal(new Set(replies.map((r) => r.body)).size, 1, 'with wait: all 50 got the same body')
    t.equal(replies.filter((r) => r.headers['idempotent-replayed'] === 'true').length, 49, '49 replays')
    t.same(await rows('plugin', key2), [{ state: 'completed' }], 'one completed row')
  })

  t.test('two processes racing on the same keys: one execution per key', async (t) => {
    await storeOn('multi')
    const env = { IDEM_TABLE: 'multi', IDEM_LEASE: '5000', IDEM_WAIT: '5000', IDEM_DELAY: '30' }
    const [a, b] = await Promise.all([spawnInstance(t, env), spawnInstance(t, env)])
    const keys = Array.from({ length: 10 }, () => `multi-${randomUUID()}`)
    const send = async (port: number, key: string): Promise<{ status: number, body: string }> => {
      const res = await fetch(`http://127.0.0.1:${port}/pay`, { method: 'POST', headers: keyed(key), body: '{"amount":100}' })
      return { status: res.status, body: await res.text() }
    }
    const results = await Promise.all(keys.map((key) =>
      Promise.all(Array.from({ length: 8 }, (_, i) => send(i % 2 === 0 ? a.port : b.port, key)))))
    const pids = new Set<number>()
    for (const [i, key] of keys.entries()) {
      const answers = results[i] ?? []
      t.ok(answers.every((r) => r.status === 201), `${key.slice(0, 13)}: all 8 got 201`)
      t.equal(new Set(answers.map((r) => r.body)).size, 1, `${key.slice(0, 13)}: all 8 got the same body`)
      const executed = await executionsOf(key)
      t.equal(executed.length, 1, `${key.slice(0, 13)}: executed once across both processes`)
      for (const pid of executed) pids.add(pid)
      t.same(await rows('multi', key), [{ state: 'completed' }])
    }
    t.ok([...pids].every((pid) => pid === a.child.pid || pid === b.child.pid), 'executions happened in the two instances')
    t.comment(`executions per instance: ${[a, b].map((x) => [...pids].filter((pid) => pid === x.child.pid).length).join(' / ')} of ${keys.length} keys (by distinct pid)`)
  })

  t.test('a process killed mid-handler: 409 until its lease lapses, then one takeover', async (t) => {
    const store = await storeOn('crash')
    t.teardown(() => store.close())
    const crashing = await spawnInstance(t, { IDEM_TABLE: 'crash', IDEM_LEASE: '500', IDEM_HOLD: '1' })
    const key = `crash-${randomUUID()}`
    const inFlight = fetch(`http://127.0.0.1:${crashing.port}/pay`, { method: 'POST', headers: keyed(key), body: '{"amount":100}' }).catch(() => null)
    t.equal(await crashing.next('held'), key, 'the handler is running in the child')
    crashing.child.kill('SIGKILL')
    await new Promise((resolve) => crashing.child.once('exit', resolve))
    const killedAt = Date.now()
    t.equal(await inFlight, null, 'the first client lost its connection')

    const retrier = await app(t, store, { lease: 500 })
    const early = await pay(retrier.app, key)
    t.equal(early.statusCode, 409, 'a retry before the lease lapses gets 409')
    let res = early
    await until(t, 'the takeover', async () => {
      res = await pay(retrier.app, key)
      return res.statusCode !== 409
    }, 3000)
    t.equal(res.statusCode, 201, 'a retry after the lease lapsed executes')
    t.ok(Date.now() - killedAt < 2000, `taken over ${Date.now() - killedAt} ms after the kill`)
    t.equal((JSON.parse(res.body) as { pid: number }).pid, process.pid, 'executed by the surviving instance')
    t.equal(retrier.executions(), 1)
    t.same(await executionsOf(key), [crashing.child.pid, process.pid], 'the killed execution, then exactly one takeover')
    t.same(await rows('crash', key), [{ state: 'completed' }], 'exactly one completed row')
    const replay = await pay(retrier.app, key)
    t.equal(replay.headers['idempotent-replayed'], 'true')
    t.equal(replay.body, res.body)
  })

  t.test('zombie fencing across two clients: a taken-over owner cannot complete, renew or release', async (t) => {
    const other = client('idem-zombie')
    const first = await storeOn('zombie')
    const second = postgresStore({ ...storeConnection(other), schema, table: 'zombie', purgeInterval: 0 })
    t.teardown(async () => { await first.close(); await second.close() })
    const key = `zombie-${randomUUID()}`
    const zombie = await first.claim({ scope: 's', key, fingerprint: A, leaseMs: 50, ttlMs: LONG })
    if (zombie.outcome !== 'acquired') return t.fail('not acquired')
    await sleep(100)
    const takeover = await second.claim({ scope: 's', key, fingerprint: A, leaseMs: LONG, ttlMs: LONG })
    if (takeover.outcome !== 'acquired') return t.fail('not taken over')
    t.equal(takeover.takeover, true)
    t.equal(await first.renew(zombie.lease, LONG), false, 'renew → false')
    t.equal(await first.complete(zombie.lease, response('zombie'), LONG), false, 'complete → false')
    t.equal(await first.release(zombie.lease), false, 'release → false')
    t.equal(await first.complete({ ...zombie.lease, token: 'not-a-uuid' }, response('zombie'), LONG), false, 'a malformed token owns nothing')
    t.ok(await second.complete(takeover.lease, response('new owner'), LONG))
    const record = await first.get({ scope: 's', key })
    t.equal(record?.state === 'completed' ? record.response.body?.toString() : null, 'new owner', "the new owner's record stands")
  })

  t.test('racing takeovers and reclaims: exactly one winner each', async (t) => {
    const store = await storeOn('races')
    const serializable = client('idem-serializable', { connection: { default_transaction_isolation: 'serializable' } })
    const strict = postgresStore({ ...storeConnection(serializable), schema, table: 'races', purgeInterval: 0 })
    t.teardown(async () => { await store.close(); await strict.close() })
    // Leases and records are made to lapse by moving their times in SQL, not by sleeping: a slow
    // machine must not turn a late claim of the batch into a legitimate takeover.
    const lapse = (key: string, column: 'lease_expires_at' | 'expires_at'): Promise<unknown> =>
      sql`UPDATE ${sql(schema)}.races SET ${sql(column)} = now() - interval '1 second' WHERE scope = 's' AND key = ${key}`
    const race = (s: IdempotencyStore, key: string, fingerprint: Fingerprint): Promise<ClaimResult[]> =>
      Promise.all(Array.from({ length: 30 }, () => s.claim({ scope: 's', key, fingerprint, leaseMs: LONG, ttlMs: LONG })))
    for (const [label, s] of [['read committed', store], ['serializable', strict]] as const) {
      const key = `race-${randomUUID()}`
      const first = (await race(s, key, A)).filter((r) => r.outcome === 'acquired')
      t.equal(first.length, 1, `${label}: one fresh claim of 30`)
      await lapse(key, 'lease_expires_at')
      const taken = (await race(s, key, A)).filter((r) => r.outcome === 'acquired')
      t.equal(taken.length, 1, `${label}: one takeover of 30`)
      t.equal(taken[0]?.outcome === 'acquired' && taken[0].takeover, true, 'reported as a takeover')
      await lapse(key, 'expires_at')
      const reclaimed = (await race(s, key, fp('another request'))).filter((r) => r.outcome === 'acquired')
      t.equal(reclaimed.length, 1, `${label}: one reclaim of an expired record of 30`)
      t.equal(reclaimed[0]?.outcome === 'acquired' && reclaimed[0].takeover, false, 'a reclaim is not a takeover')
      const record = await s.get({ scope: 's', key })
      t.ok(record?.state === 'in_progress' && record.fingerprint.digest.equals(fp('another request').digest), 'the reclaimed record is the new request')
    }
  })

  t.test('pg_terminate_backend of the store connections mid-request: a clear answer, no stuck key, no lost record', async (t) => {
    await storeOn('terminate')
    const victimName = `idem-victim-${id}`
    const victim = client('idem-victim', { max: 4 })
    const store = postgresStore({ ...storeConnection(victim), schema, table: 'terminate', purgeInterval: 0 })
    t.teardown(() => store.close())
    const terminate = async (): Promise<number> => {
      const killed = await sql`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = ${victimName}`
      return killed.length
    }
    const blocked = (): Promise<boolean> => waitingOnLock(victimName)

    t.test('while the handler runs', async (t) => {
      const { app: instance, executions } = await app(t, store, { lease: 2000 }, async () => { t.ok(await terminate() > 0, 'terminated') })
      const key = `term-${randomUUID()}`
      const res = await pay(instance, key)
      t.equal(res.statusCode, 201, "the handler's response")
      const again = await pay(instance, key)
      t.equal(again.headers['idempotent-replayed'], 'true', 'recorded: a retry replays')
      t.equal(again.body, res.body)
      t.equal(executions(), 1)
    })

    t.test('while the claim waits', async (t) => {
      const { app: instance, executions } = await app(t, store, { lease: 2000 })
      const key = `term-${randomUUID()}`
      // Another transaction holds an uncommitted row for the key, so the claim's insert waits on it.
      const admin = await sql.reserve()
      await admin`BEGIN`
      await admin`INSERT INTO ${sql(schema)}.terminate (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, expires_at)
                  VALUES ('test', ${key}, ${Buffer.alloc(1)}, 'x', 'in_progress', ${randomUUID()}, now() + interval '1 minute')`
      const pending = pay(instance, key)
      await until(t, 'the claim to block', blocked)
      await terminate()
      const res = await pending
      await admin`ROLLBACK`
      admin.release()
      t.equal(res.statusCode, 503, 'the plugin answers 503')
      t.match(res.headers['content-type'], /application\/problem\+json/)
      t.equal(res.headers['retry-after'], '1')
      t.equal(executions(), 0)
      t.same(await rows('terminate', key), [], 'nothing was claimed')
      const retry = await pay(instance, key)
      t.equal(retry.statusCode, 201, 'a retry executes: the key is not stuck')
      t.equal(executions(), 1)
    })

    t.test('while the response is being recorded', async (t) => {
      const admin = await sql.reserve()
      t.teardown(() => admin.release())
      const { app: instance, executions } = await app(t, store, { lease: 2000 }, async (key) => {
        // Lock the in-progress row so the store's complete() waits on it.
        await admin`BEGIN`
        await admin`SELECT 1 FROM ${sql(schema)}.terminate WHERE scope = 'test' AND key = ${key} FOR UPDATE`
      })
      const key = `term-${randomUUID()}`
      const pending = pay(instance, key)
      await until(t, 'complete() to block', blocked)
      await terminate()
      await sleep(20)
      await admin`COMMIT`
      const res = await pending
      t.equal(res.statusCode, 201, "the handler's response")
      const again = await pay(instance, key)
      t.equal(again.headers['idempotent-replayed'], 'true', 'the retried complete() recorded it: a retry replays')
      t.equal(again.body, res.body)
      t.equal(executions(), 1)
      t.same(await rows('terminate', key), [{ state: 'completed' }])
    })
  })

  t.test('retention: expired records are purged in batches while claims continue', async (t) => {
    const store = await storeOn('retention', { purgeBatch: 100 })
    t.teardown(() => store.close())
    const scope = 'retention'
    const claimAll = async (keys: string[], ttlMs: number): Promise<void> => {
      for (let i = 0; i < keys.length; i += 50) {
        await Promise.all(keys.slice(i, i + 50).map(async (key, j) => {
          const claim = await store.claim({ scope, key, fingerprint: A, leaseMs: Math.min(ttlMs, LONG), ttlMs })
          if (claim.outcome === 'acquired' && j % 2 === 0) await store.complete(claim.lease, response(key), ttlMs)
        }))
      }
    }
    const expiring = Array.from({ length: 500 }, (_, i) => `old-${i}`)
    const live = Array.from({ length: 50 }, (_, i) => `live-${i}`)
    await claimAll(expiring, 400)
    await claimAll(live, LONG)
    await sleep(500)

    // Claims go on while the purge runs: new keys, and retries of expired ones (executed as new).
    let claiming = true
    let claimed = 0
    let claimedDuringPurge = 0
    let purgeRunning = false
    let takeovers = 0
    const retried = new Set<string>()
    const claims = (async () => {
      for (let i = 0; claiming; i++) {
        const key = i % 2 === 0 ? `new-${i}` : `old-${i * 7 % 500}`
        const result = await store.claim({ scope, key, fingerprint: fp('retry'), leaseMs: LONG, ttlMs: LONG })
        if (result.outcome !== 'acquired') continue
        if (result.takeover) takeovers++
        claimed++
        if (purgeRunning) claimedDuringPurge++
        if (key.startsWith('old-')) retried.add(key)
      }
    })()
    await until(t, 'claims to run', () => claimed >= 5)
    purgeRunning = true
    const batches: number[] = []
    for (;;) {
      const purged = await store.purgeExpired(100)
      batches.push(purged)
      if (purged === 0) break
      await sleep(5) // a real purger paces its batches; claims interleave with them
    }
    purgeRunning = false
    claiming = false
    await claims
    const purged = batches.reduce((a, b) => a + b, 0)
    t.ok(batches.every((n) => n <= 100), `batches of at most 100: ${batches.join(', ')}`)
    t.ok(purged <= 500 && purged + retried.size >= 500, `every expired record was purged (${purged}) or claimed anew (${retried.size})`)
    t.equal(takeovers, 0, 'an expired record is claimed as new, not taken over')
    const [counts] = await sql<Array<{ expired: number, live: number, old: number }>>`
      SELECT count(*) FILTER (WHERE expires_at <= now())::int AS expired, count(*) FILTER (WHERE expires_at > now())::int AS live,
             count(*) FILTER (WHERE key LIKE 'old-%')::int AS old
      FROM ${sql(schema)}.retention WHERE scope = ${scope}`
    t.equal(counts?.expired, 0, 'no expired record left')
    t.equal(counts?.live, 50 + claimed, 'the live records and the new claims stayed')
    t.equal(counts?.old, retried.size, 'the only old keys left are the ones claimed anew')
    t.ok(claimedDuringPurge > 0, `${claimedDuringPurge} claims ran while the purge did`)

    const { app: instance, executions } = await app(t, store, { ttl: 300, lease: 300 })
    const key = `ttl-${randomUUID()}`
    const first = await pay(instance, key)
    t.equal((await pay(instance, key)).headers['idempotent-replayed'], 'true', 'replayed within the ttl')
    await sleep(400)
    const after = await pay(instance, key)
    t.equal(after.statusCode, 201)
    t.equal(after.headers['idempotent-replayed'], undefined, 'a retry after expiry executes as new')
    t.not(after.body, first.body)
    t.equal(executions(), 2)
  })

  t.test('the purge never deletes a record reclaimed while it ran', async (t) => {
    const store = await storeOn('purge_race')
    t.teardown(() => store.close())
    const claim = await store.claim({ scope: 's', key: 'r', fingerprint: A, leaseMs: 10, ttlMs: 10 })
    t.equal(claim.outcome, 'acquired')
    await sleep(50)
    // A concurrent claim reclaims the expired record (uncommitted) while the purge picks it.
    const admin = await sql.reserve()
    await admin`BEGIN`
    await admin`UPDATE ${sql(schema)}.purge_race SET expires_at = now() + interval '1 minute' WHERE scope = 's' AND key = 'r'`
    const purging = store.purgeExpired()
    await until(t, 'the purge to block on the row', () => waitingOnLock(`idem-test-${id}`))
    await admin`COMMIT`
    admin.release()
    t.equal(await purging, 0, 'the reclaimed record is not purged')
    t.equal((await store.get({ scope: 's', key: 'r' }))?.state, 'in_progress')
  })

  t.test('the purge timer deletes expired records; close() stops it', async (t) => {
    await storeOn('timer')
    const store = postgresStore({ ...storeConnection(sql), schema, table: 'timer', purgeInterval: 30, purgeBatch: 7 })
    for (let i = 0; i < 20; i++) await store.claim({ scope: 's', key: `k${i}`, fingerprint: A, leaseMs: 20, ttlMs: 20 })
    const count = async (): Promise<number> => (await sql<Array<{ n: number }>>`SELECT count(*)::int AS n FROM ${sql(schema)}.timer`)[0]?.n ?? -1
    await until(t, 'the timer to purge', async () => await count() === 0, 3000)
    await store.close()
    for (let i = 0; i < 5; i++) await store.claim({ scope: 's', key: `after${i}`, fingerprint: A, leaseMs: 1, ttlMs: 1 })
    await sleep(150)
    t.equal(await count(), 5, 'no purge after close()')
  })

  t.test("leases and expiry follow the database clock, whatever the app's clock says", async (t) => {
    const store = await storeOn('skew')
    t.teardown(() => store.close())
    const realNow = Date.now
    for (const skew of [3_600_000, -3_600_000]) {
      Date.now = () => realNow() + skew
      try {
        const key = `skew-${skew}`
        const claim = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 1000, ttlMs: LONG })
        if (claim.outcome !== 'acquired') return t.fail('not acquired')
        const second = await store.claim({ scope: 's', key, fingerprint: A, leaseMs: 1000, ttlMs: LONG })
        t.ok(second.outcome === 'in_progress' && second.leaseRemainingMs > 500 && second.leaseRemainingMs <= 1000,
          `skew ${skew}: lease remaining by DB time (${second.outcome === 'in_progress' ? second.leaseRemainingMs : '?'} ms)`)
        const [times] = await sql<Array<{ lease: number, ttl: number }>>`
          SELECT extract(epoch FROM lease_expires_at - now())::float8 * 1000 AS lease, extract(epoch FROM expires_at - now())::float8 * 1000 AS ttl
          FROM ${sql(schema)}.skew WHERE scope = 's' AND key = ${key}`
        t.ok(times !== undefined && times.lease > 500 && times.lease <= 1000, `skew ${skew}: lease_expires_at is DB now + 1 s`)
        t.ok(times !== undefined && times.ttl > LONG - 1000 && times.ttl <= LONG, `skew ${skew}: expires_at is DB now + ttl`)
        t.ok(await store.complete(claim.lease, response('skewed'), 200))
        t.equal((await store.get({ scope: 's', key }))?.state, 'completed')
        await sleep(300)
        t.equal(await store.get({ scope: 's', key }), null, `skew ${skew}: expired after 200 ms of DB time`)
      } finally {
        Date.now = realNow
      }
    }
  })
}
