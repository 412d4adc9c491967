import { createHash } from 'node:crypto'
import t from 'tap'
import { memoryStore, type MemoryStore } from '../../lib/index.js'
import type { Fingerprint, StoredRecord, StoredResponse } from '../../lib/core/store.js'

/**
 * Identical header sets are shared between records, so an array inside one that stayed the caller's
 * own, shared and mutable, would let whoever appends to it in place (an app hook on a reply) change
 * every record sharing the set, other tenants' included. What the store keeps is copied on the way
 * in and frozen deep down, so no caller, recording or reading, can change a record. (The plugin's
 * half, copying headers on record and on replay, is tested with the plugin.)
 */

const fp: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('x').digest() }

async function record (store: MemoryStore, scope: string, key: string, headers: Record<string, string | string[]>): Promise<void> {
  const claim = await store.claim({ scope, key, fingerprint: fp, leaseMs: 1000, ttlMs: 60_000 })
  if (claim.outcome !== 'acquired') throw new Error(`${scope}/${key}: ${claim.outcome}`)
  if (!await store.complete(claim.lease, { statusCode: 201, headers, body: Buffer.from('{}') }, 60_000)) throw new Error('not completed')
}

const headersOf = (record: StoredRecord | null): StoredResponse['headers'] | null => record?.state === 'completed' ? record.response.headers : null

/** Appends in place, as a hook would; a frozen array refuses (TypeError in strict code), which is the point. */
function tryAppend (value: unknown, item: string): void {
  try { (value as string[]).push(item) } catch {}
}

const HEADERS = (): Record<string, string | string[]> => ({ 'content-type': 'application/json', link: ['</a>; rel="a"', '</b>; rel="b"'], vary: ['accept'] })

t.test('the caller\'s header arrays are copied: changing them after the record was made changes no record', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const given = HEADERS()
  await record(store, 'tenant-a', 'k', given)
  ;(given.link as string[]).push('</evil>; rel="evil"')
  given.vary = 'cookie'
  t.same(headersOf(await store.get({ scope: 'tenant-a', key: 'k' })), HEADERS(), 'the record holds what was recorded')
})

t.test('headers handed out are frozen deep down: a caller appending to a returned array changes neither that record nor one sharing the set', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  await record(store, 'tenant-a', 'k', HEADERS())
  await record(store, 'tenant-b', 'k', HEADERS())

  const read = headersOf(await store.get({ scope: 'tenant-a', key: 'k' }))
  t.ok(Object.isFrozen(read), 'the set is frozen')
  t.ok(Object.isFrozen(read?.link), 'and so are the arrays in it')
  tryAppend(read?.link, '</evil>; rel="evil"')
  const claimed = await store.claim({ scope: 'tenant-a', key: 'k', fingerprint: fp, leaseMs: 1000, ttlMs: 60_000 })
  tryAppend(claimed.outcome === 'completed' ? claimed.response.headers.vary : null, 'cookie')
  const inspected = await store.inspect({ scope: 'tenant-a', key: 'k' })
  tryAppend(inspected?.response?.headers.link, '</evil2>')

  t.same(headersOf(await store.get({ scope: 'tenant-a', key: 'k' })), HEADERS(), 'the record read again is unchanged')
  t.same(headersOf(await store.get({ scope: 'tenant-b', key: 'k' })), HEADERS(), 'and so is another tenant\'s record with the same headers')
  const replayed = await store.claim({ scope: 'tenant-b', key: 'k', fingerprint: fp, leaseMs: 1000, ttlMs: 60_000 })
  t.same(replayed.outcome === 'completed' ? replayed.response.headers : null, HEADERS(), 'a replay hands out the recorded headers')
})
