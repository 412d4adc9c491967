import type {
  ClaimAcquired, ClaimRequest, ClaimResult, Fingerprint, IdempotencyStore, Lease, RecordId, StepResults, StoredRecord, StoredResponse
} from '../../lib/core/store.js'
import { now, touch } from './clock.js'
import type { Network } from './network.js'

/*
 * The store the simulated instances share: the store contract (lib/core/store.ts) over a plain map, in
 * both modes. Lease mode: one short operation per call. Atomic mode: a claim opens a transaction
 * that holds the key's lock until the plugin commits (complete) or rolls back (release); a claim
 * of a locked key reports it in progress at once, without waiting (the driver's tried lock). The
 * handler's writes (effects) go through the transaction and exist only once it commits.
 *
 * Every call goes through the simulated network (network.ts): it reaches the store after a delay,
 * may fail before or after it was applied, and its answer may come late or never.
 */

export interface ModelRecord {
  readonly key: string
  state: 'in_progress' | 'completed'
  fingerprint: Fingerprint
  token: string
  leaseUntil: number
  /** Held for the reconciler: never taken over. */
  held: boolean
  response: StoredResponse | null
  steps: Map<string, string>
}

/** An effect of the operation: a charge. Lease mode writes it at once; atomic mode through its transaction. */
export interface Effect {
  readonly key: string
  readonly request: number
  readonly at: number
}

export interface Transaction {
  readonly token: string
  readonly key: string
  readonly request: number | null
  /** The record this transaction wrote (uncommitted until it commits). */
  readonly record: ModelRecord
  state: 'open' | 'committed' | 'rolled-back'
  readonly writes: Effect[]
}

/** What the handle given to an atomic handler (`request.idempotency.sql`) does in the simulation. */
export interface TransactionHandle {
  write (effect: Effect): void
}

export interface StoreObserver {
  /** A claim acquired a key (applied on the store), for the request that sent it (null when unknown). */
  acquired (token: string, key: string, request: number | null, takeover: boolean): void
  /** A record's state changed. */
  changed (key: string, what: string, token: string): void
}

export class StoreModel {
  readonly records = new Map<string, ModelRecord>()
  /** Lease tokens from the run's seed, so that a seed's trace is the same every time. */
  readonly #token: () => string
  readonly transactions = new Map<string, Transaction>()
  /** Key → the open transaction holding its lock. */
  readonly locks = new Map<string, Transaction>()
  readonly committedEffects: Effect[] = []

  constructor (private readonly observer: StoreObserver, random: () => number) {
    this.#token = () => Array.from({ length: 4 }, () => Math.floor(random() * 2 ** 32).toString(16).padStart(8, '0')).join('-')
  }

  get openTransactions (): number { return this.locks.size }

  claim (request: ClaimRequest, requestId: number | null): ClaimResult {
    const record = this.records.get(request.key)
    if (record === undefined) {
      const created = this.#newRecord(request)
      this.records.set(request.key, created)
      this.observer.acquired(created.token, request.key, requestId, false)
      return { outcome: 'acquired', lease: leaseOf(request, created.token), takeover: false }
    }
    return this.#claimExisting(record, request, requestId)
  }

  #claimExisting (record: ModelRecord, request: ClaimRequest, requestId: number | null, open: (record: ModelRecord) => void = () => {}): ClaimResult {
    if (record.state === 'completed') {
      return { outcome: 'completed', fingerprint: record.fingerprint, response: record.response as StoredResponse, expiresInMs: 86_400_000 }
    }
    if (record.leaseUntil <= now() && !record.held && sameFingerprint(record.fingerprint, request.fingerprint)) {
      const token = this.#token()
      const previous = record.token
      open({ ...record, token, leaseUntil: now() + request.leaseMs })
      if (this.locks.get(request.key)?.record.token !== token) {
        record.token = token
        record.leaseUntil = now() + request.leaseMs
      }
      this.observer.changed(request.key, `taken over from ${short(previous)}`, token)
      this.observer.acquired(token, request.key, requestId, true)
      return { outcome: 'acquired', lease: leaseOf(request, token), takeover: true }
    }
    return { outcome: 'in_progress', fingerprint: record.fingerprint, leaseRemainingMs: Math.max(0, record.leaseUntil - now()) }
  }

  #newRecord (request: ClaimRequest): ModelRecord {
    return { key: request.key, state: 'in_progress', fingerprint: request.fingerprint, token: this.#token(), leaseUntil: now() + request.leaseMs, held: false, response: null, steps: new Map() }
  }

  /**
   * Atomic mode: the claim inside a new transaction. A key locked by another open transaction is
   * not waited for: in progress at once, its record unseen (the driver's tried advisory lock).
   */
  claimInTransaction (request: ClaimRequest, requestId: number | null, answer: (result: ClaimResult) => void): void {
    const attempt = (): boolean => {
      if (this.locks.has(request.key)) return false
      const existing = this.records.get(request.key)
      let opened: Transaction | null = null
      const open = (record: ModelRecord): void => {
        opened = { token: record.token, key: request.key, request: requestId, record, state: 'open', writes: [] }
        this.transactions.set(record.token, opened)
        this.locks.set(request.key, opened)
      }
      let result: ClaimResult
      if (existing === undefined) {
        const created = this.#newRecord(request)
        open(created)
        this.observer.acquired(created.token, request.key, requestId, false)
        result = { outcome: 'acquired', lease: leaseOf(request, created.token), takeover: false }
      } else {
        result = this.#claimExisting(existing, request, requestId, open)
      }
      if (result.outcome === 'acquired' && opened !== null) {
        const handle: TransactionHandle = { write: (effect) => { this.#write(opened as Transaction, effect) } }
        result = { ...result, transaction: handle } satisfies ClaimAcquired
      }
      answer(result)
      return true
    }
    if (attempt()) return
    touch()
    answer({ outcome: 'in_progress', fingerprint: request.fingerprint, leaseRemainingMs: 0, unseen: true })
  }

  /**
   * The connection of a transaction died (a call on it failed or went unanswered): the server rolls
   * the transaction back once it notices, unless it had committed.
   */
  connectionLost (token: string): void {
    const transaction = this.transactions.get(token)
    if (transaction === undefined || transaction.state !== 'open') return
    this.#endTransaction(transaction, 'rolled-back')
    this.observer.changed(transaction.key, 'rolled back (its connection died)', token)
  }

  #write (transaction: Transaction, effect: Effect): void {
    if (transaction.state !== 'open') throw new Error('sim: the transaction has ended; nothing more is written through it')
    transaction.writes.push(effect)
  }

  #endTransaction (transaction: Transaction, state: 'committed' | 'rolled-back'): void {
    transaction.state = state
    this.locks.delete(transaction.key)
    this.transactions.delete(transaction.token)
  }

  #owned (lease: Lease): ModelRecord | undefined {
    const record = this.records.get(lease.key)
    return record !== undefined && record.state === 'in_progress' && record.token === lease.token ? record : undefined
  }

  complete (lease: Lease, response: StoredResponse): boolean {
    const transaction = this.transactions.get(lease.token)
    if (transaction !== undefined) {
      if (transaction.state !== 'open') return false
      const record = transaction.record
      record.state = 'completed'
      record.response = response
      this.records.set(lease.key, record)
      this.committedEffects.push(...transaction.writes)
      this.#endTransaction(transaction, 'committed')
      this.observer.changed(lease.key, 'committed', lease.token)
      return true
    }
    const record = this.#owned(lease)
    if (record === undefined) return false
    record.state = 'completed'
    record.response = response
    record.steps.clear()
    this.observer.changed(lease.key, 'completed', lease.token)
    return true
  }

  release (lease: Lease): boolean {
    const transaction = this.transactions.get(lease.token)
    if (transaction !== undefined) {
      if (transaction.state !== 'open') return false
      this.#endTransaction(transaction, 'rolled-back')
      this.observer.changed(lease.key, 'rolled back', lease.token)
      return true
    }
    const record = this.#owned(lease)
    if (record === undefined) return false
    this.records.delete(lease.key)
    this.observer.changed(lease.key, 'released', lease.token)
    return true
  }

  renew (lease: Lease, leaseMs: number): boolean {
    if (this.transactions.has(lease.token)) return true
    const record = this.#owned(lease)
    if (record === undefined) return false
    record.leaseUntil = now() + leaseMs
    return true
  }

  hold (lease: Lease): boolean {
    const record = this.#owned(lease)
    if (record === undefined) return false
    record.held = true
    record.leaseUntil = now()
    this.observer.changed(lease.key, 'held', lease.token)
    return true
  }

  get (id: RecordId): StoredRecord | null {
    const record = this.records.get(id.key)
    if (record === undefined) return null
    return record.state === 'completed'
      ? { state: 'completed', fingerprint: record.fingerprint, response: record.response as StoredResponse }
      : { state: 'in_progress', fingerprint: record.fingerprint, leaseRemainingMs: Math.max(0, record.leaseUntil - now()) }
  }

  loadSteps (lease: Lease): StepResults | null {
    const record = this.#owned(lease)
    if (record === undefined) return null
    const steps: Record<string, unknown> = {}
    for (const [name, json] of record.steps) steps[name] = JSON.parse(json)
    return steps
  }

  saveStep (lease: Lease, name: string, json: string): boolean {
    const record = this.#owned(lease)
    if (record === undefined || record.steps.has(name)) return false
    record.steps.set(name, json)
    return true
  }
}

/**
 * The store as the plugin sees it: the model behind the simulated network. `requestOf` names the
 * simulated request a call is made for (the async context of the request), for the trace and the
 * coverage counts.
 */
export function storeOn (model: StoreModel, network: Network, requestOf: () => number | null): IdempotencyStore {
  return {
    claim: (request) => {
      const id = requestOf()
      return network.call('claim', request.key, id, () => model.claim(request, id), describeClaim)
    },
    claimInTransaction: (request) => {
      const id = requestOf()
      return network.callDeferred('claim', request.key, id, (answer, fault) => {
        model.claimInTransaction(request, id, (result) => {
          // Its answer lost, or a reset after it: the session is gone, and the server rolls back.
          if (result.outcome === 'acquired' && (fault === 'lost' || fault === 'fail-after')) {
            setTimeout(() => { touch(); model.connectionLost(result.lease.token) }, 30)
          }
          answer(result)
        })
      }, describeClaim)
    },
    complete: (lease, response) => network.call('complete', lease.key, requestOf(), () => model.complete(lease, response), String, lease.token, () => { model.connectionLost(lease.token) }),
    release: (lease) => network.call('release', lease.key, requestOf(), () => model.release(lease), String, lease.token, () => { model.connectionLost(lease.token) }),
    renew: (lease, leaseMs) => network.call(leaseMs === 0 ? 'give-up' : 'renew', lease.key, requestOf(), () => model.renew(lease, leaseMs), String, lease.token),
    hold: (lease) => network.call('hold', lease.key, requestOf(), () => model.hold(lease), String, lease.token),
    get: async (id) => model.get(id),
    loadSteps: (lease) => network.call('loadSteps', lease.key, requestOf(), () => model.loadSteps(lease), () => 'steps', lease.token),
    saveStep: (lease, name, json) => network.call('saveStep', lease.key, requestOf(), () => model.saveStep(lease, name, json), String, lease.token),
    purgeExpired: async () => 0,
    close: async () => {}
  }
}

function describeClaim (result: ClaimResult): string {
  if (result.outcome !== 'acquired') return result.outcome
  return `${result.takeover ? 'taken over' : 'acquired'} ${short(result.lease.token)}`
}

export const short = (token: string): string => token.slice(0, 6)

function leaseOf (request: ClaimRequest, token: string): Lease {
  return { scope: request.scope, key: request.key, token }
}

function sameFingerprint (a: Fingerprint, b: Fingerprint): boolean {
  return a.algorithm === b.algorithm && a.digest.equals(b.digest)
}
