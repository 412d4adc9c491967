/**
 * The claim statement against the single-statement alternative Citus would run as one router
 * statement (issue 15: "a claim form that is a single router statement on Citus without costing a
 * round trip on plain PostgreSQL, measure both"), on plain PostgreSQL, side by side:
 * `DATABASE_URL=postgres://… npx tsx benchmarks/postgres-claim-forms.ts [--quick]`.
 *
 * - `cte`: the driver's claim (drivers/postgres/statements.ts): a data-modifying CTE, INSERT … ON
 *   CONFLICT DO NOTHING, and a read of the row in the way when the insert did nothing. On Citus the
 *   CTE and the read run as two steps (two coordinator–worker round trips).
 * - `upsert`: INSERT … ON CONFLICT DO UPDATE SET key = EXCLUDED.key RETURNING the row, with
 *   (xmax = 0) telling an insert from a conflict. One plain INSERT, so one router statement on
 *   Citus, and its SET is a column reference (citus-notes 1 allows no more). It is NOT equivalent:
 *   every duplicate writes a new row version (WAL, a dead tuple, a row lock that a concurrent
 *   duplicate waits for, and under SERIALIZABLE a serialization failure between two replays of
 *   one key), where the driver's duplicate only reads.
 *
 * Two paths, each in interleaved rounds (both forms every round, the order alternating), medians:
 * `fresh` (every claim a new key: the insert wins) and `duplicate` (every claim a key that holds a
 * completed record: the replay path). CONCURRENCY claims in flight on a pool of as many connections.
 * Ratios are upsert / cte in claims per second (above 1: the upsert is faster); then the WAL bytes
 * a duplicate claim writes, per form.
 */
import { createHash, randomUUID } from 'node:crypto'
import postgres from 'postgres'
import { createStatements, type ClaimArgs } from '../drivers/postgres/statements.js'
import { migrate } from '../drivers/postgres/schema.js'
import { postgresJsClient } from '../drivers/postgres/postgres-js.js'

const url = process.env.DATABASE_URL
if (url === undefined || url === '') throw new Error('DATABASE_URL is not set')
const quick = process.argv.includes('--quick')
const ROUNDS = quick ? 1 : 9
const CLAIMS = quick ? 200 : 4000
const CONCURRENCY = 8
const DUPLICATE_KEYS = 1000

const schema = `idem_bench_claim_${randomUUID().slice(0, 8)}`
const sql = postgres(url, { max: CONCURRENCY, onnotice: () => {}, fetch_types: false })
await migrate(sql, { schema, table: 'records' })
const table = `"${schema}".records`
const statements = createStatements(postgresJsClient(sql), table)
const upsertText = `
  INSERT INTO ${table} (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, lease_expires_at, expires_at)
  VALUES ($1, $2, $3::bytea, $4, 'in_progress', $5::uuid, now() + $6::float8 * interval '1 millisecond',
          greatest(now() + $7::float8 * interval '1 millisecond', now() + $6::float8 * interval '1 millisecond'))
  ON CONFLICT (scope, key) DO UPDATE SET key = EXCLUDED.key
  RETURNING xmax = 0, state, fingerprint_algorithm, fingerprint, owner_token::text, expires_at <= now(),
    lease_expires_at <= now() AND NOT indeterminate,
    greatest(0, ceil((extract(epoch FROM lease_expires_at) - extract(epoch FROM now())) * 1000))::float8,
    response_status, response_headers, CASE WHEN expires_at > now() THEN response_body END,
    greatest(0, floor((extract(epoch FROM expires_at) - extract(epoch FROM now())) * 1000))::float8`

const digest = createHash('sha256').update('bench').digest()
const args = (key: string): ClaimArgs => ({ scope: 'bench', key, fingerprint: { algorithm: 'canonical-v1', digest }, token: randomUUID(), leaseMs: 60_000, ttlMs: 3_600_000 })
type Form = 'cte' | 'upsert'
/** One claim; true when it acquired the key. */
async function claim (form: Form, key: string): Promise<boolean> {
  const a = args(key)
  if (form === 'cte') return (await statements.claim(a))?.acquired === true
  const [row] = await sql.unsafe(upsertText, [a.scope, a.key, a.fingerprint.digest, a.fingerprint.algorithm, a.token, a.leaseMs, a.ttlMs], { prepare: true }).values()
  return row?.[0] === true
}

// The duplicate path's keys hold completed records, as a replayed key does.
for (let i = 0; i < DUPLICATE_KEYS; i++) {
  await sql.unsafe(`INSERT INTO ${table} (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, response_status, response_headers, response_body, expires_at)
    VALUES ('bench', $1, $2, 'canonical-v1', 'completed', $3::uuid, 201, '{}'::jsonb, $4, now() + interval '1 hour')`, [`dup-${i}`, digest, randomUUID(), Buffer.alloc(200)])
}

let fresh = 0
/** Claims per second of CLAIMS claims, CONCURRENCY at a time; checks each outcome. */
async function measure (form: Form, path: 'fresh' | 'duplicate'): Promise<number> {
  let next = 0
  const start = process.hrtime.bigint()
  await Promise.all(Array.from({ length: CONCURRENCY }, async () => {
    while (next < CLAIMS) {
      const i = next++
      const key = path === 'fresh' ? `fresh-${fresh++}` : `dup-${i % DUPLICATE_KEYS}`
      const acquired = await claim(form, key)
      if (acquired !== (path === 'fresh')) throw new Error(`${form} ${path}: claim of ${key} acquired=${acquired}`)
    }
  }))
  return CLAIMS / (Number(process.hrtime.bigint() - start) / 1e9)
}

const median = (values: number[]): number => { const s = [...values].sort((a, b) => a - b); return s[Math.floor(s.length / 2)] as number }
const results: Record<string, Record<Form, number[]>> = { fresh: { cte: [], upsert: [] }, duplicate: { cte: [], upsert: [] } }
// Warm-up: prepares the statements on every connection.
for (const form of ['cte', 'upsert'] as const) { await measure(form, 'fresh'); await measure(form, 'duplicate') }
for (let round = 0; round < ROUNDS; round++) {
  for (const path of ['fresh', 'duplicate'] as const) {
    const order: Form[] = round % 2 === 0 ? ['cte', 'upsert'] : ['upsert', 'cte']
    for (const form of order) results[path]![form].push(await measure(form, path))
  }
}
for (const [path, byForm] of Object.entries(results)) {
  const cte = median(byForm.cte)
  const upsert = median(byForm.upsert)
  console.log(`${path.padEnd(9)} cte ${cte.toFixed(0).padStart(6)}/s  upsert ${upsert.toFixed(0).padStart(6)}/s  upsert/cte ${(upsert / cte).toFixed(2)}`)
}
// What a duplicate claim writes: WAL bytes per claim over one more duplicate pass of each form.
for (const form of ['cte', 'upsert'] as const) {
  const [before] = await sql`SELECT pg_current_wal_insert_lsn() AS lsn`
  await measure(form, 'duplicate')
  const [written] = await sql`SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), ${before?.lsn}::pg_lsn)::float8 AS bytes`
  console.log(`duplicate ${form}: ${(Number(written?.bytes) / CLAIMS).toFixed(0)} WAL bytes per claim`)
}
await sql`DROP SCHEMA ${sql(schema)} CASCADE`
await sql.end({ timeout: 2 })
