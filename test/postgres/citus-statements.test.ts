import t from 'tap'
import type { ClaimResult, Lease } from '../../lib/core/store.js'
import { postgresStore, type OutboxMessage, type PostgresStore } from '../../drivers/postgres/index.js'
import { citusViolations } from '../helpers/citus-statements.js'
import { CLIENT_NAME, endPools, recordingConnection } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The driver's statements stay in the forms Citus distributes (docs/drivers.md, Citus): every
 * operation of the store runs against the suite's PostgreSQL through a client that records the
 * text of every statement it sends (postgres.js: its `debug` hook; node-postgres: a pool whose
 * clients record their queries), migrate(), atomic mode and the outbox included, and each text is
 * checked against the rules in test/helpers/citus-statements.ts. Each operation's outcome is
 * asserted too, so the path that sends each statement (a reclaim, a takeover, a lock timeout, a
 * failed delivery) is known to have run. The checker itself is tested on forms Citus refuses.
 *
 * Then what the reconciler's resume does to a record's expiry, on plain PostgreSQL: a held record
 * (expiry 'infinity') expires a ttl from now; a finite expiry is kept when later, moved to a ttl
 * from now when earlier. (node-postgres run: test/postgres/node-postgres/citus-statements.test.ts.)
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/citus-statements.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

const A = { algorithm: 'sha-256', digest: Buffer.alloc(32, 1) }
const HOUR = 3_600_000

t.test('the checker finds the forms Citus refuses, and passes the ones it accepts', async (t) => {
  const refused = [
    "UPDATE r SET expires_at = CASE WHEN expires_at = 'infinity' THEN now() + $4::float8 * interval '1 millisecond' ELSE expires_at END WHERE scope = $1",
    'UPDATE r SET lease_expires_at = coalesce(lease_expires_at, now()) WHERE scope = $1 AND key = $2',
    'UPDATE r SET state = $3 WHERE scope = $1 AND key = $2 RETURNING now()',
    'INSERT INTO r (scope, key, expires_at) VALUES ($1, $2, now()) ON CONFLICT (scope, key) DO UPDATE SET expires_at = now()',
    "INSERT INTO r (scope, key, expires_at) VALUES ($1, $2, $3) ON CONFLICT (scope, key) DO UPDATE SET expires_at = r.expires_at + interval '1 second'",
    'UPDATE r SET owner_token = gen_random_uuid() WHERE scope = $1 AND key = $2',
    'DELETE FROM r WHERE scope = $1 AND key = $2 AND random() < 0.5',
    'DELETE FROM r WHERE ctid IN (SELECT ctid FROM r WHERE expires_at <= now() LIMIT $1)',
    'SELECT scope, key FROM r WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED',
    'SELECT key FROM r WHERE key = $1 FOR UPDATE',
    'DELETE FROM r WHERE expires_at <= now()',
    "SELECT set_config('lock_timeout', '5', true)",
    'SELECT set_config($1, $2, true)',
    'CREATE TABLE r (scope text, key text, PRIMARY KEY (key))',
    'CREATE UNIQUE INDEX r_key ON r (key)',
    'CREATE INDEX a ON r (expires_at); CREATE INDEX b ON r (lease_expires_at)',
    'WITH done AS (UPDATE r SET state = $3 WHERE scope = $1 RETURNING statement_timestamp()) SELECT * FROM done'
  ]
  for (const text of refused) t.not(citusViolations(text).length, 0, text)
  const accepted = [
    "UPDATE r SET expires_at = greatest(nullif(expires_at, 'infinity'), now() + $4::float8 * interval '1 millisecond') WHERE scope = $1 AND key = $2",
    'SELECT CASE WHEN expires_at > now() THEN body END FROM r WHERE scope = $1 AND key = $2 -- CASE WHEN now() in a comment',
    "UPDATE r SET note = 'CASE WHEN now() END; DROP TABLE x' WHERE scope = $1",
    'WITH claimed AS (INSERT INTO r (scope, key, expires_at) VALUES ($1, $2, now()) ON CONFLICT (scope, key) DO NOTHING RETURNING true AS acquired) SELECT acquired FROM claimed UNION ALL SELECT CASE WHEN expires_at > now() THEN true END FROM r WHERE scope = $1',
    'DELETE FROM r WHERE expires_at <= now() AND (scope, key) IN (SELECT scope, key FROM r WHERE expires_at <= now() LIMIT $1::int)',
    'INSERT INTO r (scope, key, expires_at) VALUES ($1, $2, $3) ON CONFLICT (scope, key) DO UPDATE SET expires_at = EXCLUDED.expires_at',
    'SELECT key FROM r WHERE scope = $1 AND key = $2 FOR UPDATE',
    'BEGIN; set local lock_timeout = 5',
    "WITH attempt AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($6::int8) AS got, set_config('fastify_idempotency.transaction', 'open', true)) SELECT got FROM attempt",
    'CREATE TABLE r (scope text, key text, PRIMARY KEY (scope, key))'
  ]
  for (const text of accepted) t.same(citusViolations(text), [], text)
})

function suite (url: string): void {
  const { name: schema, sql } = postgresSchema(t, url, { prefix: 'idem_citus_forms', client: { max: 4 } })
  const sent = new Set<string>()
  const { connection, end: endRecorder } = recordingConnection(url, sql, sent)

  const stores: PostgresStore[] = []
  let tables = 0
  /** A store on a table of its own, or on `table` (shared with another store). */
  function store (options: { table?: string, outbox?: { deliver: (message: OutboxMessage) => void } } = {}): PostgresStore {
    const made = postgresStore({
      ...connection,
      schema,
      table: options.table ?? `records_${++tables}`,
      purgeInterval: 0,
      ...(options.outbox === undefined ? {} : { outbox: { ...options.outbox, retryDelay: 1, visibility: 1, retention: 0 } })
    })
    stores.push(made)
    return made
  }

  t.teardown(async () => {
    for (const made of stores) await made.close()
    await endRecorder()
    await endPools()
  })

  const acquired = (result: ClaimResult): Lease => {
    if (result.outcome !== 'acquired') throw new Error(`expected acquired, got ${result.outcome}`)
    return result.lease
  }
  const request = (key: string, leaseMs = HOUR, ttlMs = HOUR) => ({ scope: 'acct_a', key, fingerprint: A, leaseMs, ttlMs })

  t.test(`every statement the driver sends keeps to the forms Citus distributes (${CLIENT_NAME})`, async (t) => {
    const delivered: string[] = []
    const s = store({
      table: 'records',
      outbox: {
        deliver (message) {
          if (message.topic === 'flaky' && message.attempt === 1) throw new Error('broker unavailable')
          delivered.push(message.name)
        }
      }
    })
    const records = `"${schema}".records`

    // migrate(): a fresh schema, then an up-to-date one, then a table of an earlier version (upgraded).
    await s.migrate()
    await s.migrate()
    const legacy = store({ table: 'legacy' })
    await sql`CREATE TABLE ${sql(schema)}.legacy (
      scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, fingerprint bytea NOT NULL, fingerprint_algorithm text NOT NULL,
      state text NOT NULL, owner_token uuid NOT NULL, lease_expires_at timestamptz, response_status integer, response_headers jsonb,
      response_body bytea, created_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz NOT NULL, PRIMARY KEY (scope, key))`
    await legacy.migrate()
    t.match(await legacy.claim(request('legacy')), { outcome: 'acquired' }, 'the upgraded table works')

    // Every unique index of the tables includes scope (the distribution column).
    const unique = await sql<Array<{ index: string }>>`
      SELECT i.indexrelid::regclass::text AS index FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace
      WHERE n.nspname = ${schema} AND i.indisunique
        AND NOT EXISTS (SELECT FROM pg_attribute a WHERE a.attrelid = i.indrelid AND a.attname = 'scope' AND a.attnum = ANY (i.indkey))`
    t.same(unique, [], 'no unique index leaves out scope')

    // Lease mode: claim, replay, renew, complete, release, get.
    const lease = acquired(await s.claim(request('k1')))
    t.match(await s.claim(request('k1')), { outcome: 'in_progress' }, 'a duplicate reads the record in the way')
    t.equal(await s.renew(lease, HOUR), true)
    t.equal(await s.complete(lease, { statusCode: 201, headers: { 'content-type': 'text/plain' }, body: Buffer.from('ok') }, HOUR), true)
    t.match(await s.claim(request('k1')), { outcome: 'completed' })
    t.match(await s.get({ scope: 'acct_a', key: 'k1' }), { state: 'completed' })
    t.equal(await s.release(acquired(await s.claim(request('k2')))), true)

    // An expired record is reclaimed; a lapsed lease is taken over; an expired record is purged.
    t.equal(await s.complete(acquired(await s.claim(request('expired'))), { statusCode: 200, headers: {}, body: null }, 1), true)
    acquired(await s.claim(request('lapsed', 1)))
    acquired(await s.claim(request('purged')))
    await sleep(20)
    t.match(await s.claim(request('expired')), { outcome: 'acquired', takeover: false }, 'reclaimed')
    t.match(await s.claim(request('lapsed')), { outcome: 'acquired', takeover: true }, 'taken over')
    await sql.unsafe(`UPDATE ${records} SET expires_at = now() - interval '1 second' WHERE key = 'purged'`)
    t.equal(await s.purgeExpired(), 1)

    // Recovery points and a transactional step that enqueues two outbox messages, delivered after it
    // commits (the flaky one fails its first delivery).
    const stepped = acquired(await s.claim(request('stepped')))
    t.equal(await s.saveStep(stepped, 'charge', '{"id":"ch_1"}'), true)
    t.same(await s.loadSteps(stepped), { charge: { id: 'ch_1' } })
    const json = await s.runStepInTransaction(stepped, 'email', async (tx) => {
      await s.enqueue(tx, { scope: 'acct_a', key: 'stepped', name: 'receipt', topic: 'email', payload: { to: 'a@example.com' } })
      await s.enqueue(tx, { scope: 'acct_a', key: 'stepped', name: 'ledger', topic: 'flaky', payload: [1] })
      return 'sent'
    }, (value) => JSON.stringify(value))
    t.equal(json, '"sent"')
    s.afterCommit({ scope: 'acct_a', key: 'stepped' })
    const outbox = `${records}_outbox`
    for (let i = 0; i < 200; i++) {
      const [row] = await sql.unsafe(`SELECT count(*) FILTER (WHERE last_error IS NOT NULL)::int AS failed, count(*) FILTER (WHERE delivered_at IS NOT NULL)::int AS done FROM ${outbox}`)
      if (row?.failed === 1 && row?.done === 1) break
      await sleep(10)
    }
    t.same(delivered, ['receipt'], 'delivered after the commit; the flaky one failed')

    // Holds, the operator tools and the reconciler: complete, release, resume, leave.
    const actions: Record<string, 'complete' | 'release' | 'resume' | 'leave'> = { h1: 'complete', h2: 'release', h3: 'resume', h4: 'leave' }
    for (const key of Object.keys(actions)) t.equal(await s.hold(acquired(await s.claim(request(key)))), true)
    t.equal((await s.listHeld()).length, 4)
    t.match(await s.inspect({ scope: 'acct_a', key: 'h1' }), { indeterminate: true, expiresInMs: Infinity })
    const report = await s.reconcile({
      olderThan: 0,
      resolve: (held) => {
        const action = actions[held.key] ?? 'leave'
        return action === 'complete' ? { action, response: { statusCode: 200, body: 'resolved' } } : { action }
      }
    })
    t.match(report, { examined: 4, completed: 1, released: 1, resumed: 1, left: 1, errors: [] })
    t.equal(await s.forceRelease({ scope: 'acct_a', key: 'h4' }), true)

    // The reconciler worker (its advisory lock), then the outbox's due messages: the flaky one's retry.
    await new Promise<void>((resolve) => {
      const worker = s.startReconciler({ interval: 1, olderThan: HOUR, resolve: () => undefined, onReport: () => { void worker.stop().then(resolve) } })
    })
    await s.deliverOutbox()
    t.same(delivered.sort(), ['ledger', 'receipt'], 'the flaky message delivered on its retry')
    await sleep(5)
    t.equal(await s.purgeExpired(), 0)
    t.same(await sql.unsafe(`SELECT name FROM ${outbox}`), [], 'the delivered messages purged (retention 0) along with the records')

    // Atomic mode: commit, rollback, and a duplicate of an uncommitted claim (the key's lock tried,
    // not waited for), from another store and from the same one.
    const other = store({ table: 'records' })
    const committed = acquired(await s.claimInTransaction(request('atomic')))
    t.equal(await s.complete(committed, { statusCode: 201, headers: {}, body: null }, HOUR), true)
    t.match(await s.claimInTransaction(request('atomic')), { outcome: 'completed' })
    t.equal(await s.release(acquired(await s.claimInTransaction(request('rolled-back')))), true)
    const holding = acquired(await other.claimInTransaction(request('busy')))
    t.match(await s.claimInTransaction(request('busy')), { outcome: 'in_progress', unseen: true }, 'held elsewhere: answered at once')
    t.match(await other.claimInTransaction(request('busy')), { outcome: 'in_progress', unseen: true }, 'held here: answered at once')
    t.equal(await other.release(holding), true)

    const found = [...sent].map((text) => ({ text: text.replace(/\s+/g, ' ').trim(), violations: citusViolations(text) })).filter((entry) => entry.violations.length > 0)
    t.same(found, [], `${sent.size} distinct statements sent; none breaks a rule`)
    t.ok([...sent].some((text) => /pg_try_advisory_xact_lock/.test(text)), 'the atomic claim tries the key\'s lock')
  })

  t.test(`resume: a held record becomes an ordinary one whose lease has lapsed, expiring no earlier than a ttl from now (${CLIENT_NAME})`, async (t) => {
    const s = store()
    await s.migrate()
    const ttl = 60_000
    // A held record ('infinity'), a record expiring in an hour and one expiring in a second: the
    // reconciler's lease (1 s) leaves each expiry as it was, or later, before it resumes them.
    t.equal(await s.hold(acquired(await s.claim(request('held')))), true)
    acquired(await s.claim(request('later', 1, HOUR)))
    acquired(await s.claim(request('sooner', 1, 1000)))
    await sleep(10)
    await s.saveStep(acquired(await s.claim(request('stepped', 1, HOUR))), 'charge', '{"id":"ch_1"}')
    await sleep(10)
    const report = await s.reconcile({ olderThan: 0, lease: 1000, ttl, resolve: () => ({ action: 'resume' }) })
    t.match(report, { examined: 4, resumed: 4, errors: [] })
    for (const [key, expected] of [['held', ttl], ['later', HOUR], ['sooner', ttl], ['stepped', HOUR]] as const) {
      const record = await s.inspect({ scope: 'acct_a', key })
      t.match(record, { state: 'in_progress', indeterminate: false, leaseRemainingMs: 0 }, `${key}: no longer held, its lease lapsed`)
      const expiresIn = record?.expiresInMs ?? 0
      t.ok(expiresIn > expected - 5_000 && expiresIn <= expected, `${key}: expires in ${expiresIn} ms, about ${expected}`)
    }
    const retried = await s.claim(request('held'))
    t.match(retried, { outcome: 'acquired', takeover: true }, 'a retry takes the resumed record over')
    const resumed = await s.claim(request('stepped'))
    t.same(await s.loadSteps(acquired(resumed)), { charge: { id: 'ch_1' } }, 'with its recorded steps')
  })
}
