import { createHash, randomBytes } from 'node:crypto'
import { Redis } from 'ioredis'
import t from 'tap'
import { redisPrefilter } from '../../drivers/redis/index.js'
import { FIELD, recordKey } from '../../drivers/redis/keys.js'
import type { RecordId } from '../../lib/core/store.js'

/**
 * The Redis pre-filter reads back only records it understands: a hash under its key that it cannot
 * read whole (written by someone else under the prefix, or by an incompatible version) is a miss,
 * and the store answers, which is always correct; replaying a half-understood record would not be.
 * A ttl that is not a number is a caller's bug, refused.
 */

const REDIS_URL = process.env.REDIS_URL
if (REDIS_URL === undefined) {
  t.fail('REDIS_URL must be set: run `node scripts/test.mjs test/redis/prefilter-unreadable-records.test.ts` (it starts a throwaway Redis server).')
} else {
  const client = new Redis(REDIS_URL, { maxRetriesPerRequest: 1 })
  const prefix = `unreadable-${randomBytes(4).toString('hex')}`
  const prefilter = redisPrefilter({ client, prefix, timeout: 2000 })
  const digest = createHash('sha256').update('body').digest()
  const written: string[] = []
  t.teardown(async () => {
    await prefilter.close()
    if (written.length > 0) await client.del(...written)
    client.disconnect()
  })

  /** A hash written straight into Redis under the record's key, and what the pre-filter's lookup makes of it. */
  async function lookupOf (key: string, fields: Record<string, string | Buffer>): Promise<unknown> {
    const id: RecordId = { scope: 'tenant', key }
    const redisKey = recordKey(prefix, id)
    written.push(redisKey)
    await client.hset(redisKey, fields)
    return await prefilter.lookup(id)
  }

  const completed = (overrides: Record<string, string>): Record<string, string | Buffer> => ({
    [FIELD.state]: 'completed',
    [FIELD.algorithm]: 'canonical-v1',
    [FIELD.digest]: digest,
    [FIELD.status]: '201',
    [FIELD.headers]: '{"content-type":"application/json"}',
    [FIELD.body]: '{"ok":true}',
    ...overrides
  })

  t.test('a completed record it can read whole is a hit (the control case)', async (t) => {
    t.match(await lookupOf('readable', completed({})), {
      state: 'completed',
      fingerprint: { algorithm: 'canonical-v1', digest },
      response: { statusCode: 201, headers: { 'content-type': 'application/json' }, body: Buffer.from('{"ok":true}') }
    })
  })

  t.test('anything it cannot read whole is a miss', async (t) => {
    const cases: Array<[string, Record<string, string | Buffer>]> = [
      ['no state', { [FIELD.algorithm]: 'canonical-v1', [FIELD.digest]: digest }],
      ['an unknown state', completed({ [FIELD.state]: 'archived' })],
      ['a status that is not a number', completed({ [FIELD.status]: 'created' })],
      ['a status below 100', completed({ [FIELD.status]: '42' })],
      ['a status above 999', completed({ [FIELD.status]: '1000' })],
      ['headers that are not JSON', completed({ [FIELD.headers]: '{"content-type":' })],
      ['headers that are a JSON array', completed({ [FIELD.headers]: '["content-type","text/plain"]' })],
      ['headers that are JSON null', completed({ [FIELD.headers]: 'null' })],
      ['a header whose value is a number', completed({ [FIELD.headers]: '{"content-length":12}' })],
      ['a header whose list holds a number', completed({ [FIELD.headers]: '{"set-cookie":["a=1",2]}' })]
    ]
    const before = prefilter.stats
    for (const [name, fields] of cases) t.equal(await lookupOf(name, fields), null, name)
    const noHeaders = completed({})
    delete noHeaders[FIELD.headers]
    t.equal(await lookupOf('no headers', noHeaders), null, 'no headers')
    const after = prefilter.stats
    t.equal(after.misses - before.misses, cases.length + 1, 'each counted as a miss')
    t.equal(after.hits, before.hits, 'none as a hit')
    t.equal(after.failures, before.failures, 'none as a failure')
  })

  t.test('a ttl that is not a number is refused', async (t) => {
    const id: RecordId = { scope: 'tenant', key: 'ttl' }
    const fingerprint = { algorithm: 'canonical-v1', digest }
    for (const ttl of ['1000', Number.NaN]) {
      await t.rejects(prefilter.markInFlight(id, fingerprint, ttl as number), {
        name: 'TypeError',
        message: `fastify-idempotency: redis pre-filter markInFlight() needs a ttl in ms; received ${String(ttl)}`
      })
    }
    t.equal(await client.exists(recordKey(prefix, id)), 0, 'nothing was written')
  })
}
