/**
 * The driver's claim statement against its alternatives, on PostgreSQL alone:
 * `npm run bench:claim-forms` (about 2 min; `-- --quick`: seconds; `-- --out file`: another summary file).
 * Each form is one prepared statement:
 * - `cte`: the driver's claim (drivers/postgres/statements.ts): INSERT … ON CONFLICT DO NOTHING in a
 *   data-modifying CTE, and a read of the row in the way when the insert did nothing.
 * - `upsert`: INSERT … ON CONFLICT DO UPDATE SET key = EXCLUDED.key RETURNING the row, (xmax = 0)
 *   telling an insert from a conflict: one plain INSERT, so one router statement on Citus, but every
 *   duplicate writes a row version (WAL, a dead tuple, a row lock a concurrent duplicate waits for).
 * - `read-first`: the row read first (a materialized CTE), the insert run only when nothing was found.
 * - `select`: duplicates only, the bound: the read without the insert (a fresh key would then need
 *   a second round trip to claim).
 * Two paths: `fresh` (every claim a new key) and `duplicate` (a key holding a completed record: the
 * replay path), CONCURRENCY claims in flight on as many connections, in interleaved rounds whose
 * order reverses (medians): claims per second, PostgreSQL's CPU per claim (every postgres process's
 * user + system time from /proc, in 10 ms ticks) and the WAL bytes a duplicate writes. Writes the
 * `claimForms` section of benchmarks/results/summary.json.
 */
import { createHash, randomUUID } from 'node:crypto'
import { readdirSync, readFileSync } from 'node:fs'
import { parseArgs } from 'node:util'
import postgres from 'postgres'
import { createStatements, later, RECORD_COLUMNS, type ClaimArgs } from '../drivers/postgres/statements.js'
import { migrate } from '../drivers/postgres/schema.js'
import { postgresJsClient } from '../drivers/postgres/postgres-js.js'
import { median } from './figures.js'
import { benchServices } from './services.js'
import { summaryPath, writeSection, type ClaimFormFigures, type ClaimFormsSection } from './summary-file.js'

const { values: options } = parseArgs({ options: { quick: { type: 'boolean', default: false }, out: { type: 'string' } } })
const quick = options.quick === true
const ROUNDS = quick ? 1 : 9
const CLAIMS = quick ? 200 : 4000
const CONCURRENCY = 8
const DUPLICATE_KEYS = quick ? 100 : 1000

/** CPU time so far of every PostgreSQL process, ms (null off Linux): utime + stime, stat's 14th and 15th fields. */
function postgresCpuMs (): number | null {
  if (process.platform !== 'linux') return null
  let ticks = 0
  for (const pid of readdirSync('/proc').filter((entry) => /^\d+$/.test(entry))) {
    let stat: string
    try { stat = readFileSync(`/proc/${pid}/stat`, 'utf8') } catch { continue } // gone since readdir
    const close = stat.lastIndexOf(')') // the command name may hold spaces and parentheses
    if (stat.slice(stat.indexOf('(') + 1, close) !== 'postgres') continue
    const fields = stat.slice(close + 2).split(' ')
    ticks += Number(fields[11]) + Number(fields[12])
  }
  return ticks * 10 // USER_HZ is 100 on Linux
}

const services = await benchServices()
const schema = `idem_bench_claim_${randomUUID().slice(0, 8)}`
const sql = postgres(services.databaseUrl, { max: CONCURRENCY, onnotice: () => {}, fetch_types: false })
await migrate(sql, { schema, table: 'records' })
const table = `"${schema}".records`
const statements = createStatements(postgresJsClient(sql), table)

const COLUMNS = '(scope, key, fingerprint, fingerprint_algorithm, state, owner_token, lease_expires_at, expires_at)'
const upsertText = `
  INSERT INTO ${table} ${COLUMNS}
  VALUES ($1, $2, $3::bytea, $4, 'in_progress', $5::uuid, ${later(6)}, greatest(${later(7)}, ${later(6)}))
  ON CONFLICT (scope, key) DO UPDATE SET key = EXCLUDED.key
  RETURNING xmax = 0, ${RECORD_COLUMNS}`
const readFirstText = `
  WITH existing AS MATERIALIZED (
    SELECT ${RECORD_COLUMNS} FROM ${table} WHERE scope = $1 AND key = $2
  ), claimed AS (
    INSERT INTO ${table} ${COLUMNS}
    SELECT $1, $2, $3::bytea, $4, 'in_progress', $5::uuid, ${later(6)}, greatest(${later(7)}, ${later(6)})
    WHERE NOT EXISTS (SELECT FROM existing)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING true AS acquired
  )
  SELECT acquired, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM claimed
  UNION ALL
  SELECT false, * FROM existing`
const selectText = `SELECT ${RECORD_COLUMNS} FROM ${table} WHERE scope = $1 AND key = $2`

const digest = createHash('sha256').update('bench').digest()
const args = (key: string): ClaimArgs => ({ scope: 'bench', key, fingerprint: { algorithm: 'canonical-v1', digest }, token: randomUUID(), leaseMs: 60_000, ttlMs: 3_600_000 })
const claimValues = (a: ClaimArgs): postgres.ParameterOrJSON<never>[] => [a.scope, a.key, a.fingerprint.digest, a.fingerprint.algorithm, a.token, a.leaseMs, a.ttlMs]
async function firstColumn (text: string, values: postgres.ParameterOrJSON<never>[]): Promise<unknown> {
  const [row] = await sql.unsafe(text, values, { prepare: true }).values()
  return row?.[0]
}

type Form = 'cte' | 'upsert' | 'read-first' | 'select'
type Path = 'fresh' | 'duplicate'
const FORMS: Record<Path, Form[]> = { fresh: ['cte', 'upsert', 'read-first'], duplicate: ['cte', 'upsert', 'read-first', 'select'] }
/** One claim; true when it acquired the key (for `select`: when it found no row). */
async function claim (form: Form, key: string): Promise<boolean> {
  const a = args(key)
  switch (form) {
    case 'cte': return (await statements.claim(a))?.acquired === true
    case 'upsert': return await firstColumn(upsertText, claimValues(a)) === true
    case 'read-first': return await firstColumn(readFirstText, claimValues(a)) === true
    case 'select': return await firstColumn(selectText, [a.scope, a.key]) === undefined
  }
}

// The duplicate path's keys hold completed records, as a replayed key does.
for (let i = 0; i < DUPLICATE_KEYS; i++) {
  await sql.unsafe(`INSERT INTO ${table} (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, response_status, response_headers, response_body, expires_at)
    VALUES ('bench', $1, $2, 'canonical-v1', 'completed', $3::uuid, 201, '{"content-type":"application/json; charset=utf-8"}'::jsonb, $4, now() + interval '1 hour')`,
  [`dup-${i}`, digest, randomUUID(), Buffer.alloc(200)])
}

let fresh = 0
/** CLAIMS claims, CONCURRENCY at a time, each outcome checked: claims per second and PostgreSQL's CPU µs per claim. */
async function measure (form: Form, path: Path): Promise<{ rate: number, pgCpuUs: number | null }> {
  let next = 0
  const cpuBefore = postgresCpuMs()
  const start = process.hrtime.bigint()
  await Promise.all(Array.from({ length: CONCURRENCY }, async () => {
    while (next < CLAIMS) {
      const i = next++
      const key = path === 'fresh' ? `fresh-${fresh++}` : `dup-${i % DUPLICATE_KEYS}`
      const acquired = await claim(form, key)
      if (acquired !== (path === 'fresh')) throw new Error(`${form} ${path}: claim of ${key} acquired=${acquired}`)
    }
  }))
  const rate = CLAIMS / (Number(process.hrtime.bigint() - start) / 1e9)
  const cpuAfter = postgresCpuMs()
  return { rate, pgCpuUs: cpuBefore === null || cpuAfter === null ? null : (cpuAfter - cpuBefore) * 1000 / CLAIMS }
}

const rates = { fresh: {}, duplicate: {} } as Record<Path, Partial<Record<Form, number[]>>>
const cpu = { fresh: {}, duplicate: {} } as Record<Path, Partial<Record<Form, number[]>>>
// Warm-up: prepares the statements on every connection.
for (const path of ['fresh', 'duplicate'] as const) for (const form of FORMS[path]) await measure(form, path)
for (let round = 0; round < ROUNDS; round++) {
  for (const path of ['fresh', 'duplicate'] as const) {
    const order = round % 2 === 0 ? FORMS[path] : [...FORMS[path]].reverse()
    for (const form of order) {
      const { rate, pgCpuUs } = await measure(form, path)
      ;(rates[path][form] ??= []).push(rate)
      if (pgCpuUs !== null) (cpu[path][form] ??= []).push(pgCpuUs)
    }
  }
}

const [server] = await sql`SHOW server_version`
const result: ClaimFormsSection = { postgres: String(server?.server_version).split(' ')[0]!, rounds: ROUNDS, claims: CLAIMS, concurrency: CONCURRENCY, paths: { fresh: {}, duplicate: {} }, walBytesPerDuplicate: {} }
for (const path of ['fresh', 'duplicate'] as const) {
  const cte = median(rates[path].cte!)
  const rows: Record<string, ClaimFormFigures> = {}
  for (const form of FORMS[path]) {
    const rate = median(rates[path][form]!)
    const pgCpu = cpu[path][form] === undefined ? null : median(cpu[path][form])
    rows[form] = { claimsPerSecond: Math.round(rate), toCte: Math.round(rate / cte * 100) / 100, pgCpuUsPerClaim: pgCpu === null ? null : Math.round(pgCpu * 10) / 10 }
    console.log(`${path.padEnd(9)} ${form.padEnd(10)} ${rate.toFixed(0).padStart(6)}/s  ${(rate / cte).toFixed(2)}× cte  PostgreSQL ${pgCpu === null ? '–' : pgCpu.toFixed(1)} µs CPU per claim`)
  }
  result.paths[path] = rows
}
// What a duplicate claim writes: WAL bytes per claim over one more duplicate pass of each form.
for (const form of FORMS.duplicate) {
  const [before] = await sql`SELECT pg_current_wal_insert_lsn() AS lsn`
  await measure(form, 'duplicate')
  const [written] = await sql`SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), ${before?.lsn}::pg_lsn)::float8 AS bytes`
  const bytes = Math.round(Number(written?.bytes) / CLAIMS)
  result.walBytesPerDuplicate[form] = bytes
  console.log(`duplicate ${form}: ${bytes} WAL bytes per claim`)
}
const out = summaryPath(options.out, quick)
writeSection(out, 'claimForms', result)
console.log(`written to ${out}`)
await sql`DROP SCHEMA ${sql(schema)} CASCADE`
await sql.end({ timeout: 2 })
await services.stop()
