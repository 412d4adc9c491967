import { createHash, randomUUID } from 'node:crypto'
import postgres from 'postgres'
import t from 'tap'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import type { ClaimRequest, Fingerprint } from '../../lib/core/store.js'
import { eventually } from '../helpers/app.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The Postgres store's answers at its edges, through its own interface (as the plugin and the
 * reconciler call it): an atomic claim of a key whose record expired but was not purged yet, an
 * atomic claim given back with release(), a wait that is not a number of ms, an atomic claim on a
 * table that does not exist, steps asked for with a lease that no longer owns the record, steps
 * recorded as JSON values rather than as their text, a stuck record taken by a retry before the
 * reconciler acquires it, and a background purge that fails.
 */

const fp: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('body').digest() }
const request = (key: string, overrides: Partial<ClaimRequest> = {}): ClaimRequest => ({ scope: 'acct', key, fingerprint: fp, leaseMs: 10_000, ttlMs: 60_000, ...overrides })
const response = { statusCode: 201, headers: { 'content-type': 'text/plain' }, body: Buffer.from('done') }

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/store-edges.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const sql = postgres(url, { max: 4, onnotice: () => {} })
  const { name: schema, sql: admin } = postgresSchema(t, url, { prefix: 'idem_edges', client: { max: 2 }, migrate: ['records'] })
  const stores: PostgresStore[] = []
  t.teardown(async () => {
    for (const store of stores) await store.close()
    await sql.end({ timeout: 2 })
  })
  const store = (options: Partial<Parameters<typeof postgresStore>[0]> = {}): PostgresStore => {
    const made = postgresStore({ sql, schema, table: 'records', purgeInterval: 0, ...options } as Parameters<typeof postgresStore>[0])
    stores.push(made)
    return made
  }
  const rows = async (key: string): Promise<number> => Number((await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.records WHERE key = ${key}`)[0]?.n)

  t.test('an atomic claim of a key whose record expired, not purged yet, takes it as a fresh record', async (t) => {
    const s = store()
    const first = await s.claim(request('expired', { ttlMs: 50 }))
    if (first.outcome !== 'acquired') return t.fail('not acquired')
    t.equal(await s.complete(first.lease, response, 50), true)
    await sleep(80)
    t.equal(await rows('expired'), 1, 'the expired record is still in the table')
    const other: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('another body').digest() }
    const again = await s.claimInTransaction?.(request('expired', { fingerprint: other }))
    t.match(again, { outcome: 'acquired', takeover: false }, 'a fresh claim, even for another body')
    if (again?.outcome !== 'acquired') return
    t.equal(await s.complete(again.lease, { ...response, body: Buffer.from('again') }, 60_000), true)
    t.match(await s.get({ scope: 'acct', key: 'expired' }), { state: 'completed', response: { body: Buffer.from('again') } })
  })

  t.test('release() of an atomic claim rolls its transaction back: no record is left', async (t) => {
    const s = store()
    const claim = await s.claimInTransaction?.(request('rolled-back'))
    if (claim?.outcome !== 'acquired') return t.fail('not acquired')
    t.equal(s.openTransactions, 1)
    t.equal(await s.renew(claim.lease, 1000), true, 'renew: the open transaction holds the record, there is no lease to extend')
    t.equal(await s.release(claim.lease), true)
    t.equal(s.openTransactions, 0)
    t.equal(await rows('rolled-back'), 0)
    t.equal(await s.release(claim.lease), false, 'a second release finds nothing of its own')
  })

  t.test('an atomic claim on a table that does not exist rejects with the server\'s error, leaving no transaction open', async (t) => {
    const s = store({ table: 'never_migrated' })
    await t.rejects(s.claimInTransaction?.(request('nowhere')) ?? Promise.resolve(), { code: '42P01' })
    t.equal(s.openTransactions, 0)
  })

  t.test('steps asked for with a lease that does not own the record: null', async (t) => {
    const s = store()
    const claim = await s.claim(request('steps-owner'))
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    t.equal(await s.saveStep?.(claim.lease, 'charge', '{"id":"ch_1"}'), true)
    t.same(await s.loadSteps?.(claim.lease), { charge: { id: 'ch_1' } })
    t.equal(await s.loadSteps?.({ ...claim.lease, token: randomUUID() }), null, 'another token')
    t.equal(await s.loadSteps?.({ ...claim.lease, key: 'nobody' }), null, 'another key')
  })

  t.test('steps recorded as JSON values rather than as their text read back as those values', async (t) => {
    const s = store()
    const claim = await s.claim(request('steps-values'))
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    await admin`UPDATE ${admin(schema)}.records SET steps = ${admin.json({ charge: { id: 'ch_2', amount: 5 }, text: '"quoted"' })} WHERE key = 'steps-values'`
    t.same(await s.loadSteps?.(claim.lease), { charge: { id: 'ch_2', amount: 5 }, text: 'quoted' }, 'a value as it is; a string as the JSON it holds')
  })

  t.test('a stuck record a retry took over before the reconciler acquired it is skipped', async (t) => {
    const s = store()
    for (const key of ['stuck-a', 'stuck-b']) await s.claim(request(key, { leaseMs: 1 }))
    await sleep(20)
    const seen: string[] = []
    const report = await s.reconcile({
      olderThan: 0,
      resolve: async (record) => {
        seen.push(record.key)
        const retry = await s.claim(request(record.key === 'stuck-a' ? 'stuck-b' : 'stuck-a'))
        t.equal(retry.outcome, 'acquired', 'the retry took the other one over')
        return { action: 'release' }
      }
    })
    t.equal(seen.length, 1)
    t.match(report, { examined: 1, released: 1, errors: [] })
  })

  t.test('a background purge that fails goes to onBackgroundError; a reporter that throws is contained', async (t) => {
    const reported: Array<[string, string]> = []
    let throwing = 0
    store({ table: 'never_migrated', purgeInterval: 5, onBackgroundError: (error, task) => { reported.push([task, String((error as { code?: unknown }).code)]) } })
    store({ table: 'never_migrated', purgeInterval: 5, onBackgroundError: () => { throwing++; throw new Error('the reporter failed') } })
    await eventually(() => reported.length >= 2 && throwing >= 2, 5000)
    t.ok(reported.length >= 2, 'reported on every tick')
    t.same(reported[0], ['purge', '42P01'])
    t.ok(throwing >= 2, 'the throwing reporter was called again on the next tick: nothing escaped the timer')
  })
}
