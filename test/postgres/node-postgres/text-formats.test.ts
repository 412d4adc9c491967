import { createHash } from 'node:crypto'
import pg from 'pg'
import t from 'tap'
import { postgresStore } from '../../../drivers/postgres/index.js'
import { parseTimestamp } from '../../../drivers/postgres/node-postgres-types.js'
import type { Fingerprint } from '../../../lib/core/store.js'
import { postgresSchema } from '../../helpers/postgres-schema.js'

/**
 * node-postgres hands the store its rows as text, which the store parses itself
 * (drivers/postgres/node-postgres-types.ts). What the text looks like is the server's session
 * settings': bytea in the `escape` format (backslashes and octal) rather than hex, timestamps with
 * a negative offset, or one in minutes. The store reads its records the same under any of them.
 */

const BINARY = Buffer.from(Array.from({ length: 256 }, (_, i) => i))
const fp: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('body').digest() }

t.test('parseTimestamp reads the ISO DateStyle the server writes, and nothing else', async (t) => {
  t.equal(parseTimestamp('2026-12-02 00:38:46.742123+00').toISOString(), '2026-12-02T00:38:46.742Z', 'fraction cut to milliseconds')
  t.equal(parseTimestamp('2026-12-01 21:08:46-03:30').toISOString(), '2026-12-02T00:38:46.000Z', 'a negative offset in hours and minutes')
  t.equal(parseTimestamp('1900-01-01 00:53:28+00:53:28').toISOString(), '1900-01-01T00:00:00.000Z', 'an offset with seconds (a historic local mean time)')
  t.equal(parseTimestamp('0099-06-01 00:00:00+00').toISOString(), '0099-06-01T00:00:00.000Z', 'a year before 100 is that year, not 1999')
  t.equal(parseTimestamp('0044-03-15 12:00:00+00 BC').getUTCFullYear(), -43, '44 BC is the astronomical year -43')
  for (const text of ['infinity', '2026-12-02T00:38:46Z', '', '2026-12-02 00:38:46']) {
    t.ok(Number.isNaN(parseTimestamp(text).getTime()), `${JSON.stringify(text)}: an Invalid Date`)
  }
})

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/node-postgres/text-formats.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  const schema = postgresSchema(t, DATABASE_URL, { prefix: 'idem_text' })

  t.test('bytea in the escape format and timestamps at a negative offset in minutes: records read back the same', async (t) => {
    // Newfoundland: UTC-03:30 (UTC-02:30 in summer), so created_at comes back as `…-03:30` or `…-02:30`.
    const pool = new pg.Pool({ connectionString: DATABASE_URL, max: 2, allowExitOnIdle: true, options: '-c bytea_output=escape -c timezone=America/St_Johns' })
    const store = postgresStore({ pool, schema: schema.name, table: 'records', purgeInterval: 0 })
    t.teardown(async () => { await store.close(); await pool.end() })
    await store.migrate()

    const { rows } = await pool.query("SELECT '\\x005c7f'::bytea::text AS bytes, now()::text AS at")
    t.equal(rows[0].bytes, '\\000\\\\\\177', 'the session writes bytea escaped')
    t.match(rows[0].at, /-0[23]:30$/, 'and timestamps at the Newfoundland offset')

    const before = Date.now()
    const claim = await store.claim({ scope: 'tenant', key: 'binary', fingerprint: fp, leaseMs: 10_000, ttlMs: 60_000 })
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    t.equal(await store.saveStep(claim.lease, 'charge', JSON.stringify({ id: 'ch_\\1' })), true)
    const inProgress = await store.inspect({ scope: 'tenant', key: 'binary' })
    t.same(inProgress?.steps, { charge: { id: 'ch_\\1' } })
    t.ok(inProgress?.fingerprint.digest.equals(fp.digest), 'the fingerprint\'s digest, byte for byte')
    const createdAt = inProgress?.createdAt.getTime() ?? Number.NaN
    t.ok(createdAt >= before - 1000 && createdAt <= Date.now() + 1000, 'created_at is the instant it was written, offset applied')

    t.equal(await store.complete(claim.lease, { statusCode: 201, headers: { 'content-type': 'application/octet-stream' }, body: BINARY }, 60_000), true)
    const replay = await store.claim({ scope: 'tenant', key: 'binary', fingerprint: fp, leaseMs: 10_000, ttlMs: 60_000 })
    t.equal(replay.outcome, 'completed')
    if (replay.outcome !== 'completed') return
    t.equal(replay.response.statusCode, 201)
    t.ok(replay.response.body?.equals(BINARY), 'every byte value, backslash included, as recorded')
    t.ok(replay.fingerprint.digest.equals(fp.digest))
  })
}
