import t from 'tap'
import { HeaderSets, Slabs } from '../../drivers/memory-packing.js'

/**
 * The memory store shares slabs between records of one ttl and header sets between records with
 * identical headers, within bounds that hostile variety cannot grow: past eight distinct ttls a
 * record gets memory of its own; past 1024 interned sets per table, or for a set over 4 KiB, a
 * record gets a header set of its own. Such a set is frozen and counted like a shared one, and is
 * freed with its record.
 */

t.test('records of a ninth distinct ttl get memory of their own; the first eight share slabs', async (t) => {
  const slabs = new Slabs()
  for (let ttl = 1; ttl <= 8; ttl++) {
    t.equal(slabs.packsInSlab(16, ttl), true)
    slabs.pack(16, ttl)
    t.equal(slabs.isOwn(slabs.last), false, `ttl ${ttl}: a slab`)
  }
  t.equal(slabs.packsInSlab(16, 9), false, 'the ninth ttl is told it will not share')
  const offset = slabs.pack(16, 9)
  t.equal(offset, 0)
  t.equal(slabs.isOwn(slabs.last), true, 'a record of the ninth ttl: memory of its own')
  t.equal(slabs.buffer(slabs.last).length, 16, 'just its bytes')
  slabs.pack(16, 3)
  t.equal(slabs.isOwn(slabs.last), false, 'a known ttl still shares its slab')
})

t.test('past 1024 interned Content-Type sets, each record gets a set of its own', async (t) => {
  const sets = new HeaderSets()
  for (let i = 0; i < 1024; i++) sets.intern({ 'content-type': `application/x-${i}` })
  const shared = sets.intern({ 'content-type': 'application/x-7' })
  t.equal(shared.refs, 2, 'an interned type is shared')
  const a = sets.intern({ 'content-type': 'text/plain' })
  const b = sets.intern({ 'content-type': 'text/plain' })
  t.not(a.id, b.id, 'not interned: two sets')
  t.same(a.value, { 'content-type': 'text/plain' })
  t.ok(Object.isFrozen(a.value))
  t.equal(a.bytes, 'content-type'.length + 'text/plain'.length, 'counted like a shared set')
  sets.release(a.id)
  t.equal(sets.intern({ 'content-type': 'text/html' }).id, a.id, 'its id is free again with its record gone')
})

t.test('a header set over 4 KiB is never interned: each record has its own, frozen, arrays copied', async (t) => {
  const sets = new HeaderSets()
  const cookies = Array.from({ length: 50 }, (_, i) => `session-${i}=${'x'.repeat(100)}`)
  const headers = { 'content-type': 'application/json', 'set-cookie': cookies }
  const a = sets.intern(headers)
  const b = sets.intern(headers)
  t.not(a.id, b.id, 'two records, two sets')
  t.equal(a.signature, null)
  t.same(a.value, headers)
  t.not(a.value['set-cookie'], cookies, 'the array is a copy')
  t.ok(Object.isFrozen(a.value['set-cookie']))
  const cookieBytes = cookies.reduce((sum, cookie) => sum + cookie.length, 0)
  t.equal(a.bytes, 'content-type'.length + 'application/json'.length + 'set-cookie'.length + cookieBytes, 'counted like a shared set')
  cookies.push('late=1')
  t.equal((a.value['set-cookie'] as readonly string[]).length, 50, 'the caller changing its array changes no record')
})

t.test('past 1024 interned header sets, each record gets a set of its own', async (t) => {
  const sets = new HeaderSets()
  for (let i = 0; i < 1024; i++) sets.intern({ 'content-type': 'text/plain', etag: `"${i}"` })
  t.equal(sets.intern({ 'content-type': 'text/plain', etag: '"5"' }).refs, 2, 'an interned set is shared')
  const a = sets.intern({ 'content-type': 'text/plain', etag: '"new"' })
  const b = sets.intern({ 'content-type': 'text/plain', etag: '"new"' })
  t.not(a.id, b.id)
  t.equal(a.signature, null)
  t.same(b.value, { 'content-type': 'text/plain', etag: '"new"' })
})
