import { createHash } from 'node:crypto'
import t from 'tap'
import { PendingIndex } from '../../drivers/memory-pending.js'
import { CompletedTable, hashKey, NONE } from '../../drivers/memory-table.js'

/**
 * The memory store's indexes tell keys apart by their characters, not by their hashes: two keys of
 * one length whose 32-bit hashes are equal (for a fixed seed) are two records, in keys of one-byte
 * characters and in keys with wider ones, and a key looked up past a slot that holds another key
 * still finds its own record.
 */

const SEED = 1
const digest = createHash('sha256').update('body').digest()

/**
 * Pairs of keys of one length whose hashes are equal for SEED in bucket 0, found by a birthday
 * search over `${prefix}` and four characters of [A-Za-z0-9_-].
 */
const COLLIDING = {
  'one-byte characters': ['key-P3cC', 'key-tBAD'],
  'wider characters': ['ключ-S9cC', 'ключ-OHAD']
} as const

for (const [kind, [first, second]] of Object.entries(COLLIDING)) {
  t.test(`completed records whose keys (${kind}) hash alike are told apart`, async (t) => {
    t.equal(first.length, second.length)
    t.equal(hashKey(SEED, 0, first), hashKey(SEED, 0, second), 'the premise: the two keys\' hashes are equal')

    const table = new CompletedTable({ seed: SEED })
    const id = table.insert(0, first, digest, { statusCode: 201, body: Buffer.from('first') }, 0, 0, false, 0, 1000, 1000)
    t.equal(table.find(0, first), id)
    t.equal(table.find(0, second), NONE, 'the other key, with the same hash, is not found')
    const other = table.insert(0, second, digest, { statusCode: 202, body: Buffer.from('second') }, 0, 0, false, 0, 1000, 1000)
    t.equal(table.find(0, second), other, 'found past the first key\'s slot')
    t.equal(table.find(0, first), id)
    t.same([table.statusCode(table.find(0, first)), table.statusCode(table.find(0, second))], [201, 202])
    t.same(table.body(other), Buffer.from('second'))
  })
}

t.test('an index of records in progress full enough that keys share slots finds each key\'s own entry', async (t) => {
  const index = new PendingIndex<number>()
  const keys = Array.from({ length: 2000 }, (_, i) => `key-${i}`)
  keys.forEach((key, i) => { index.set(key, i) })
  t.equal(index.size, keys.length)
  t.ok(keys.every((key, i) => index.get(key) === i), 'every key finds its own entry')
  t.equal(index.get('key-2000'), undefined)
  for (const key of keys.slice(0, 1500)) index.delete(key)
  t.ok(keys.slice(1500).every((key, i) => index.get(key) === 1500 + i), 'and still after most were deleted')
  t.equal(index.get('key-0'), undefined)
})
