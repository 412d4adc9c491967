import { createHash } from 'node:crypto'
import t from 'tap'
import { CompletedTable, hashKey, NONE } from '../../drivers/memory-table.js'
import { memoryStore } from '../../lib/index.js'
import type { Fingerprint } from '../../lib/core/store.js'
import { manualClock } from '../helpers/app.js'

/**
 * The memory store's table of completed records (drivers/memory-table.ts): rows in typed arrays, an
 * open-addressing index, keys and bodies in slabs. These tests drive it directly where its own
 * mechanics are the point (growth, shrinking, collisions, deletion while walking), and through the
 * store where the store's outcome is.
 */

const digestOf = (text: string): Buffer => createHash('sha256').update(text).digest()
const bodyOf = (key: string): Buffer => Buffer.from(`body of ${key}`)

/** Inserts `key` in `bucket`, expiring at `expiresAt`, with a body naming the key (or `body`). */
function put (table: CompletedTable, bucket: number, key: string, expiresAt = 1000, body: Buffer | null = bodyOf(key)): number {
  return table.insert(bucket, key, digestOf(key), { statusCode: 201, body }, 0, 0, false, 1, expiresAt, 1000)
}

/** The key a record was inserted under, read back from its body (the table keeps no key a caller can read). */
function keyOf (table: CompletedTable, id: number): string {
  return String(table.body(id)).slice('body of '.length)
}

/** A tiny deterministic generator (the runs must repeat). */
function random (seed: number): () => number {
  let state = seed >>> 0
  return () => {
    state = (Math.imul(state, 1664525) + 1013904223) >>> 0
    return state / 2 ** 32
  }
}

t.test('grows by doubling from a tiny capacity and finds every record, with its bytes intact', async (t) => {
  const table = new CompletedTable({ capacity: 1 })
  t.equal(table.capacity, 1)
  const ids: number[] = []
  for (let i = 0; i < 5000; i++) ids.push(put(table, i % 3, `key-${i}`))
  t.equal(table.size, 5000)
  t.ok(table.capacity >= 5000 && table.capacity < 10_000, `capacity ${table.capacity}`)
  t.same(ids, Array.from({ length: 5000 }, (_, i) => i), 'ids are dense, in insertion order')
  let wrong = 0
  for (let i = 0; i < 5000; i++) {
    const id = table.find(i % 3, `key-${i}`)
    if (id !== i || keyOf(table, id) !== `key-${i}` || !table.digest(id).equals(digestOf(`key-${i}`)) || table.statusCode(id) !== 201) wrong++
  }
  t.equal(wrong, 0, 'every record found, with its digest, body and status')
  t.equal(table.find(0, 'key-1'), NONE, 'a key is found in its own bucket only')
  t.equal(table.find(1, 'key-5000'), NONE, 'and a key never inserted is not found')
})

t.test('never grows past maxCapacity while the records fit', async (t) => {
  const table = new CompletedTable({ capacity: 4, maxCapacity: 100 })
  for (let i = 0; i < 100; i++) put(table, 0, `k${i}`)
  t.equal(table.capacity, 100)
  put(table, 0, 'one more')
  t.equal(table.capacity, 101, 'and grows by one row past it when asked to hold more')
})

t.test('shrinks as records go, to its initial capacity, and keeps the rest findable', async (t) => {
  const table = new CompletedTable({ capacity: 8 })
  for (let i = 0; i < 4096; i++) put(table, 0, `k${i}`, i < 4000 ? 10 : 1000)
  const full = table.capacity
  t.ok(full >= 4096)
  for (const id of table.expiredIn(0, 10)) table.delete(id)
  t.equal(table.size, 96)
  t.ok(table.capacity <= 512, `shrunk from ${full} to ${table.capacity} rows for 96 records`)
  for (let i = 4000; i < 4096; i++) t.equal(keyOf(table, table.find(0, `k${i}`)), `k${i}`)
  for (let i = 0; i < 4000; i += 97) t.equal(table.find(0, `k${i}`), NONE)
  while (table.size > 0) table.delete(table.size - 1)
  t.equal(table.capacity, 8, 'empty: back to its initial capacity')
})

t.test('keys whose full 32-bit hashes are equal are told apart by their bytes', async (t) => {
  const seed = 12345
  // About 2^16 random keys make a collision likely (the birthday bound); 400,000 make it certain in
  // practice. Random keys: `key-${i}` for 400,000 i did not collide once (FNV keeps such small
  // differences apart).
  const next = random(3)
  const seen = new Map<number, string>()
  let pair: [string, string] | null = null
  for (let i = 0; i < 400_000 && pair === null; i++) {
    const key = Math.floor(next() * 2 ** 32).toString(36) + Math.floor(next() * 2 ** 32).toString(36)
    const hash = hashKey(seed, 7, key)
    const earlier = seen.get(hash)
    if (earlier !== undefined) pair = [earlier, key]
    else seen.set(hash, key)
  }
  if (pair === null) return t.fail('no collision found')
  const [a, b] = pair
  t.equal(hashKey(seed, 7, a), hashKey(seed, 7, b), `${a} and ${b} have one hash`)
  const table = new CompletedTable({ capacity: 2, seed })
  const ida = put(table, 7, a)
  const idb = put(table, 7, b)
  t.equal(table.find(7, a), ida)
  t.equal(table.find(7, b), idb)
  t.equal(table.find(8, a), NONE, 'another bucket, another hash')
  table.delete(ida)
  t.equal(table.find(7, a), NONE)
  t.equal(keyOf(table, table.find(7, b)), b, 'the other one survives its twin\'s deletion (and its move to id 0)')
})

t.test('random inserts and deletes on a tiny table agree with a Map, index and bucket links included', async (t) => {
  const next = random(42)
  const table = new CompletedTable({ capacity: 2 })
  const model = new Map<string, { bucket: number, expiresAt: number }>()
  let serial = 0
  let mismatches = 0
  for (let round = 0; round < 20_000; round++) {
    const roll = next()
    if (roll < 0.55 || model.size === 0) {
      // Few buckets and short keys: runs in the index and chains in the buckets are long.
      const prefix = serial % 7 === 0 ? 'é' : serial % 11 === 0 ? '€' : ''
      serial++
      const key = `${prefix}${Math.floor(next() * 1e9).toString(36)}`
      const bucket = Math.floor(next() * 4)
      if (model.has(`${bucket}/${key}`)) continue
      put(table, bucket, key, Math.floor(next() * 100))
      model.set(`${bucket}/${key}`, { bucket, expiresAt: 0 })
    } else if (roll < 0.9) {
      const id = Math.floor(next() * table.size)
      const bucket = table.bucketOf(id)
      model.delete(`${bucket}/${keyOf(table, id)}`)
      table.delete(id)
    } else {
      // A scope's purge: its expired records, highest id first.
      const bucket = Math.floor(next() * 4)
      const at = Math.floor(next() * 100)
      for (const id of table.expiredIn(bucket, at)) {
        if (table.bucketOf(id) !== bucket || table.expiresAt(id) > at) mismatches++
        model.delete(`${bucket}/${keyOf(table, id)}`)
        table.delete(id)
      }
    }
    if (table.size !== model.size) mismatches++
    if (round % 1000 === 0) {
      for (const name of model.keys()) {
        const slash = name.indexOf('/')
        const id = table.find(Number(name.slice(0, slash)), name.slice(slash + 1))
        if (id === NONE || keyOf(table, id) !== name.slice(slash + 1)) mismatches++
      }
      let linked = 0
      for (let bucket = 0; bucket < 4; bucket++) linked += table.expiredIn(bucket, Infinity).length
      if (linked !== table.size) mismatches++
    }
  }
  t.equal(mismatches, 0, `every step agreed (${model.size} records left, capacity ${table.capacity})`)
})

t.test('a walk from the top row down may delete as it goes, also with rows added and deleted between its steps', async (t) => {
  const next = random(7)
  const table = new CompletedTable({ capacity: 4 })
  for (let i = 0; i < 2000; i++) put(table, i % 5, `k${i}`, i % 3 === 0 ? 10 : 1000)
  // A sweep in slices of 50 rows; between slices, other records come and go (claims, reads).
  let position = table.size
  let added = 0
  while (position > 0) {
    position = Math.min(position, table.size)
    for (let budget = 50; position > 0 && budget > 0; budget--) {
      position--
      if (table.expiresAt(position) <= 10) table.delete(position)
    }
    for (let i = 0; i < 5; i++) put(table, 9, `new-${added++}`, 1000)
    table.delete(Math.floor(next() * table.size))
  }
  let left = 0
  for (let id = 0; id < table.size; id++) if (table.expiresAt(id) <= 10) left++
  t.equal(left, 0, 'every expired record was reached and deleted')
  let missing = 0
  for (let id = 0; id < table.size; id++) if (table.find(table.bucketOf(id), keyOf(table, id)) !== id) missing++
  t.equal(missing, 0, 'and the index still finds every record left')
})

t.test('keys that are not ASCII: Latin-1, UTF-16, lone surrogates, and keys that differ in a high byte only', async (t) => {
  const table = new CompletedTable({ capacity: 2 })
  const keys = ['café', 'caf\u00e9\u0000', '€uro', '\u0141', 'A', '\u0041\u0000', '\ud800', '\ufffd', '\udc00\ud800', '😀', '\u00ff', '\u01ff', '']
  const ids = keys.map((key) => put(table, 0, key))
  // By id: the body names the key in UTF-8, which cannot tell lone surrogates from U+FFFD.
  for (const [i, key] of keys.entries()) t.equal(table.find(0, key), ids[i], `${JSON.stringify(key)} is found as itself`)
  t.equal(table.find(0, 'cafe'), NONE)
  t.equal(table.find(0, '\udbff'), NONE)

  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const fp: Fingerprint = { algorithm: 'raw-v1', digest: digestOf('x') }
  const storeKeys = ['\ud800', '\ufffd', 'Ł', 'A']
  for (const [i, key] of storeKeys.entries()) {
    const claim = await store.claim({ scope: 'ś', key, fingerprint: fp, leaseMs: 1000, ttlMs: 60_000 })
    if (claim.outcome !== 'acquired') return t.fail(`${key}: ${claim.outcome}`)
    await store.complete(claim.lease, { statusCode: 200, headers: {}, body: Buffer.from(`body ${i}`) }, 60_000)
  }
  for (const [i, key] of storeKeys.entries()) {
    const record = await store.get({ scope: 'ś', key })
    t.equal(record?.state === 'completed' ? record.response.body?.toString() : null, `body ${i}`, `${JSON.stringify(key)} replays its own body`)
  }
  t.equal(store.usage().records, 4, 'four keys, four records')
})

t.test('a body that was not retained reads back as null, and costs no body bytes', async (t) => {
  const table = new CompletedTable()
  const kept = put(table, 0, 'kept', 1000, Buffer.alloc(100))
  const dropped = put(table, 0, 'dropped', 1000, null)
  const empty = put(table, 0, 'empty', 1000, Buffer.alloc(0))
  t.equal(table.body(dropped), null)
  t.same(table.body(empty), Buffer.alloc(0), 'an empty body is retained, and empty')
  t.equal(table.body(kept)?.length, 100)
  t.ok(table.digest(dropped).equals(digestOf('dropped')), 'the digest is kept either way')
  t.equal(table.heldBytes(dropped), 40, '7 key bytes and a 32-byte digest, aligned to 8')
  t.equal(table.heldBytes(kept), 136)
})

t.test('records over 8 KiB get memory of their own; small ones share a slab', async (t) => {
  const table = new CompletedTable()
  const big = Buffer.alloc(20_000, 7)
  const a = put(table, 0, 'big', 1000, big)
  const b = put(table, 0, 'small-1', 1000, Buffer.from('one'))
  const c = put(table, 0, 'small-2', 1000, Buffer.from('two'))
  const bigBody = table.body(a)
  t.ok(bigBody?.equals(big), 'read back whole')
  t.equal(bigBody?.buffer.byteLength, 3 + 32 + 20_000, 'in a buffer of exactly its bytes (key, digest, body)')
  t.ok(table.heldBytes(a) > 20_035, 'counted with that buffer\'s overhead')
  t.equal(table.body(b)?.buffer, table.body(c)?.buffer, 'the small ones in one slab')
  t.not(table.body(a)?.buffer, table.body(b)?.buffer)
  big.fill(1)
  t.equal(table.body(a)?.[0], 7, 'a copy: the caller\'s buffer changing changes no record')
  table.delete(a)
  t.equal(table.find(0, 'big'), NONE)
  t.equal(String(table.body(table.find(0, 'small-2'))), 'two', 'the record moved into the freed row reads as before')
})

t.test('through the store: expired completed records are swept from the table in slices while claims go on', async (t) => {
  const clock = manualClock()
  const store = memoryStore({ now: clock.now, purgeInterval: 5, maxEntries: 100_000, maxEntriesPerScope: 100_000 })
  t.teardown(() => store.close())
  const fp: Fingerprint = { algorithm: 'raw-v1', digest: digestOf('x') }
  for (let i = 0; i < 25_000; i++) {
    const claim = store.claim({ scope: `s${i % 3}`, key: `k${i}`, fingerprint: fp, leaseMs: 1000, ttlMs: i % 2 === 0 ? 1000 : 60_000 })
    if (claim.outcome !== 'acquired') return t.fail('not acquired')
    store.complete(claim.lease, { statusCode: 201, headers: {}, body: Buffer.from(`b${i}`) }, i % 2 === 0 ? 1000 : 60_000)
  }
  t.equal(store.usage().records, 25_000)
  clock.advance(2000)
  // The sweep (slices of 10,000 rows) runs while claims add and replay records.
  const deadline = Date.now() + 10_000
  let serial = 0
  while (store.usage().records > 12_500 + serial && Date.now() < deadline) {
    const claim = store.claim({ scope: 's0', key: `during-${serial}`, fingerprint: fp, leaseMs: 1000, ttlMs: 60_000 })
    if (claim.outcome === 'acquired') {
      store.complete(claim.lease, { statusCode: 201, headers: {}, body: null }, 60_000)
      serial++
    }
    await new Promise((resolve) => setImmediate(resolve))
  }
  t.equal(store.usage().records, 12_500 + serial, `the expired half went (${serial} records added meanwhile)`)
  t.equal(await store.purgeExpired(), 0, 'nothing expired is left')
  for (let i = 1; i < 25_000; i += 1000) {
    const record = await store.get({ scope: `s${i % 3}`, key: `k${i}` })
    t.equal(record?.state === 'completed' ? String(record.response.body) : null, `b${i}`, `k${i} kept`)
  }
  const during = await store.get({ scope: 's0', key: 'during-0' })
  t.equal(during?.state === 'completed' ? during.response.body : undefined, null, 'a record added during the sweep is kept (its body was not retained)')
})
