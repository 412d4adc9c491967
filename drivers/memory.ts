import { randomUUID } from 'node:crypto'
import { fingerprintsEqual } from '../lib/fingerprint.js'
import type {
  ClaimRequest, ClaimResult, Fingerprint, IdempotencyStore, Lease, RecordId, StoredRecord, StoredResponse
} from '../lib/store.js'

export interface MemoryStoreOptions {
  /** Most records held at once; when full (after dropping expired ones) new claims are refused. @defaultValue 1_000_000 */
  maxEntries?: number
  /** Approximate bytes of keys, headers and bodies held at once; same refusal when exceeded. @defaultValue 268_435_456 (256 MiB) */
  maxBytes?: number
  /** How often expired records are swept, in ms; 0 disables the timer (reads still honour expiry). @defaultValue 60_000 */
  purgeInterval?: number
  /** The clock, in ms since the epoch. Tests inject one to move time. @defaultValue Date.now */
  now?: () => number
}

/** Thrown by `claim` when the memory store is full of unexpired records: nothing live is ever dropped. */
export class MemoryStoreFullError extends Error {
  readonly code = 'FST_IDEMPOTENCY_MEMORY_STORE_FULL'

  constructor (limit: string) {
    super(`fastify-idempotency: the memory store is full (${limit}); no unexpired record is dropped, so new keys are refused until records expire`)
    this.name = 'MemoryStoreFullError'
  }
}

interface Entry {
  state: 'in_progress' | 'completed'
  readonly fingerprint: Fingerprint
  token: string
  leaseUntil: number
  expiresAt: number
  response: StoredResponse | null
  bytes: number
}

/** Per-record bookkeeping (Map slot, entry object, timestamps) counted against `maxBytes`. */
const ENTRY_OVERHEAD = 160
const SWEEP_SLICE = 10_000

/**
 * The embedded default: one process, nothing to install. Every operation runs synchronously inside
 * one call, so claims are atomic with respect to each other within the process; it is not shared
 * between processes (use the Postgres driver for several instances).
 */
export function memoryStore (options: MemoryStoreOptions = {}): IdempotencyStore {
  const maxEntries = positive('maxEntries', options.maxEntries, 1_000_000)
  const maxBytes = positive('maxBytes', options.maxBytes, 256 * 1024 * 1024)
  const purgeInterval = options.purgeInterval ?? 60_000
  if (!Number.isInteger(purgeInterval) || purgeInterval < 0) {
    throw new TypeError(`memoryStore: purgeInterval must be a non-negative integer number of ms; received ${String(purgeInterval)}`)
  }
  const now = options.now ?? Date.now
  if (typeof now !== 'function') throw new TypeError(`memoryStore: now must be a function; received ${typeof now}`)

  const entries = new Map<string, Entry>()
  let bytes = 0
  let lastFullPurge = -Infinity
  let sweeping = false
  let closed = false

  const timer = purgeInterval > 0 ? setInterval(sweep, purgeInterval) : null
  timer?.unref()

  function idOf (scope: string, key: string): string {
    // Length-prefixed, so no (scope, key) pair can spell another pair's id.
    return `${scope.length}:${scope}${key}`
  }

  function live (id: string, at: number): Entry | undefined {
    const entry = entries.get(id)
    if (entry !== undefined && entry.expiresAt <= at) {
      drop(id, entry)
      return undefined
    }
    return entry
  }

  function drop (id: string, entry: Entry): void {
    entries.delete(id)
    bytes -= entry.bytes
  }

  function owned (lease: Lease, at: number): Entry | undefined {
    const entry = live(idOf(lease.scope, lease.key), at)
    return entry !== undefined && entry.state === 'in_progress' && entry.token === lease.token ? entry : undefined
  }

  function makeRoom (at: number): void {
    if (entries.size < maxEntries && bytes < maxBytes) return
    // A full scan at most once a second, so a store full of live records refuses quickly.
    if (at - lastFullPurge >= 1000) {
      lastFullPurge = at
      purge(Infinity, at)
    }
    if (entries.size >= maxEntries) throw new MemoryStoreFullError(`${maxEntries} records`)
    if (bytes >= maxBytes) throw new MemoryStoreFullError(`${maxBytes} bytes`)
  }

  function purge (limit: number, at: number): number {
    let purged = 0
    for (const [id, entry] of entries) {
      if (purged >= limit) break
      if (entry.expiresAt <= at) {
        drop(id, entry)
        purged++
      }
    }
    return purged
  }

  // The timer sweeps in slices, yielding to the event loop between them, so claims never wait
  // behind a scan of a large map.
  function sweep (): void {
    if (sweeping || closed) return
    sweeping = true
    const iterator = entries.entries()
    const step = (): void => {
      if (closed) { sweeping = false; return }
      const at = now()
      for (let i = 0; i < SWEEP_SLICE; i++) {
        const next = iterator.next()
        if (next.done === true) { sweeping = false; return }
        const [id, entry] = next.value
        if (entry.expiresAt <= at) drop(id, entry)
      }
      setImmediate(step).unref()
    }
    step()
  }

  function recordOf (entry: Entry, at: number): StoredRecord {
    return entry.state === 'completed'
      ? { state: 'completed', fingerprint: entry.fingerprint, response: entry.response as StoredResponse }
      : { state: 'in_progress', fingerprint: entry.fingerprint, leaseRemainingMs: Math.max(0, entry.leaseUntil - at) }
  }

  return {
    async claim (request: ClaimRequest): Promise<ClaimResult> {
      const at = now()
      const id = idOf(request.scope, request.key)
      const entry = live(id, at)
      if (entry === undefined) {
        makeRoom(at)
        const token = randomUUID()
        const created: Entry = {
          state: 'in_progress',
          fingerprint: request.fingerprint,
          token,
          leaseUntil: at + request.leaseMs,
          expiresAt: at + request.ttlMs,
          response: null,
          bytes: ENTRY_OVERHEAD + id.length * 2
        }
        entries.set(id, created)
        bytes += created.bytes
        return { outcome: 'acquired', lease: { scope: request.scope, key: request.key, token }, takeover: false }
      }
      if (entry.state === 'in_progress' && entry.leaseUntil <= at && fingerprintsEqual(entry.fingerprint, request.fingerprint)) {
        entry.token = randomUUID()
        entry.leaseUntil = at + request.leaseMs
        return { outcome: 'acquired', lease: { scope: request.scope, key: request.key, token: entry.token }, takeover: true }
      }
      if (entry.state === 'completed') {
        return { outcome: 'completed', fingerprint: entry.fingerprint, response: entry.response as StoredResponse, expiresInMs: entry.expiresAt - at }
      }
      return { outcome: 'in_progress', fingerprint: entry.fingerprint, leaseRemainingMs: Math.max(0, entry.leaseUntil - at) }
    },

    async complete (lease: Lease, response: StoredResponse, ttlMs: number): Promise<boolean> {
      const at = now()
      const entry = owned(lease, at)
      if (entry === undefined) return false
      const body = response.body === null ? null : compact(response.body)
      const size = (body?.length ?? 0) + headerBytes(response.headers)
      entry.state = 'completed'
      entry.response = Object.freeze({ statusCode: response.statusCode, headers: Object.freeze({ ...response.headers }), body })
      entry.expiresAt = at + ttlMs
      entry.bytes += size
      bytes += size
      return true
    },

    async release (lease: Lease): Promise<boolean> {
      const entry = owned(lease, now())
      if (entry === undefined) return false
      drop(idOf(lease.scope, lease.key), entry)
      return true
    },

    async renew (lease: Lease, leaseMs: number): Promise<boolean> {
      const at = now()
      const entry = owned(lease, at)
      if (entry === undefined) return false
      entry.leaseUntil = at + leaseMs
      return true
    },

    async get (id: RecordId): Promise<StoredRecord | null> {
      const at = now()
      const entry = live(idOf(id.scope, id.key), at)
      return entry === undefined ? null : recordOf(entry, at)
    },

    async purgeExpired (limit = Infinity): Promise<number> {
      return purge(limit, now())
    },

    async close (): Promise<void> {
      closed = true
      if (timer !== null) clearInterval(timer)
      entries.clear()
      bytes = 0
    }
  }
}

function positive (name: string, value: number | undefined, fallback: number): number {
  if (value === undefined) return fallback
  if (!Number.isInteger(value) || value < 1) throw new TypeError(`memoryStore: ${name} must be a positive integer; received ${String(value)}`)
  return value
}

/**
 * Small Buffers often sit in Node's shared 8 KiB pool (Buffer.from of a short string); keeping such
 * a slice would pin the whole slab for the record's lifetime, so the bytes move to their own memory.
 */
function compact (body: Buffer): Buffer {
  if (body.byteOffset === 0 && body.buffer.byteLength === body.length) return body
  const copy = Buffer.allocUnsafeSlow(body.length)
  body.copy(copy)
  return copy
}

function headerBytes (headers: Readonly<Record<string, string | string[]>>): number {
  let size = 0
  for (const name in headers) {
    const value = headers[name]
    size += name.length + (Array.isArray(value) ? value.join('').length : (value ?? '').length)
  }
  return size
}
