import type { RequestState } from './context.js'
import type { Engine } from './engine.js'
import { StoreTimeoutError } from './errors.js'
import { observe } from './observe.js'
import { schedules, type Scheduled } from './schedule.js'
import type { ClaimAcquired, Lease } from './store.js'
import { withTimeout } from './timeout.js'
import { localId } from './waiters.js'

/*
 * The lifecycle of one protected request: its phase, and what keeps its key. Every change of phase
 * and every start or stop of the lease's renewal happens in this file; the hooks, the claim and the
 * settling code ask for a transition and act on what it answers.
 *
 * The rule: a lease exists to detect a DEAD owner (seeds: "a row stuck in in_progress because the
 * process crashed must eventually be claimable"), not a departed client or a slow consumer. A live
 * owner keeps its key until its outcome is written. So, in lease mode, the lease is renewed every
 * lease/3 from the claim until the store has settled the key (recorded the response, released the
 * key or held it for the reconciler), whatever the client does meanwhile: a client that leaves, a
 * socket timeout, a stream the client reads slowly, the retries of a failed record write change
 * nothing. Renewal stops, and the key can then be taken over once its lease lapses, only when:
 *   - the store settled the key (phase `settled`);
 *   - the store refused a renewal: another attempt owns the key now (`lost`);
 *   - the route's `maxOwnership` elapsed while this owner still held the key (an explicit bound on
 *     stuck handlers, off by default);
 *   - the process died (no timer runs any more).
 * An answer that interrupts the handler (Fastify's `handlerTimeout` answers 503 while the handler
 * runs on) is settled only once the handler has returned: until then the handler may still produce
 * its effect, and a retry must not run the operation beside it. If the handler then completes, its
 * answer never reached the client and its effect may have happened: the key is held for the
 * reconciler (indeterminate); if it fails, the usual rules apply. Atomic mode has no lease to renew: the open transaction holds the record, and a client that leaves
 * rolls it back with everything the handler wrote (its later queries fail).
 *
 * | phase          | transition (asked by)                          | next        | the lease (lease mode)             |
 * |----------------|------------------------------------------------|-------------|------------------------------------|
 * | parsed         | own: the store handed over the key (claim)     | owner       | renewal starts                     |
 * | parsed         | replayed / answered / unprotected (claim)      | that phase  | none was taken                     |
 * | owner          | clientLeft: the socket closed, onTimeout       | owner       | kept: renewal goes on              |
 * | owner (atomic) | clientLeft                                     | settling    | the transaction is rolled back     |
 * | owner          | respond: the answer reaches onSend             | settling    | kept until the store settles       |
 * | owner          | unsent: onResponse without onSend (hijack)     | settling    | kept until the store settles       |
 * | settling       | settled: the store answered (or we gave up)    | settled     | renewal stops, local waiters wake  |
 * | owner/settling | the store refused a renewal                    | unchanged   | renewal stops (`lost`)             |
 * | owner/settling | maxOwnership elapsed                           | unchanged   | renewal stops, the lease lapses    |
 */

/** Where a protected request stands. */
export type Phase = 'parsed' | 'owner' | 'settling' | 'settled' | 'replayed' | 'answered' | 'unprotected'

/** How the route's handler ended: its promise resolved (or it returned), or it threw (rejected). */
export type HandlerOutcome = 'returned' | 'threw'

/** What onSend does with a payload, as `respond()` decides. */
export type Response =
  /** This request owns the key and the answer is its outcome: settle it. */
  | 'settle'
  /** Not the owner's answer (a replay, a problem, an error page after settling): send it untouched. */
  | 'pass'
  /**
   * A second reply.send() while the first answer is still being settled (an async handler that
   * calls reply.send() without returning reply): Fastify sends the first one; this one is dropped,
   * as Fastify drops a send after the response ended.
   */
  | 'duplicate'

/** Owners due for a renewal, one schedule per renewal interval (lib/schedule.ts). */
const renewals = schedules<Lifecycle>((lifecycle) => {
  lifecycle.renewOnSchedule().catch(/* c8 ignore next: renewOnSchedule catches the store's failures */ () => {})
}, false)

export class Lifecycle implements Scheduled {
  // The renewal schedule's links (lib/schedule.ts): the owner waits in it between renewals.
  dueAt = 0
  previous: Scheduled | null = null
  next: Scheduled | null = null
  scheduled = false

  #phase: Phase = 'parsed'
  #lease: Lease | null = null
  #transactional = false
  #engine: Engine | null = null
  #renewing = false
  #lost = false
  #ownedAt = 0
  /** onSend of the owner's answer has started and not yet handed the payload back to Fastify. */
  #responding = false
  /** The route's handler is running (lease mode; tracked by the handler wrapper, lib/hooks.ts). */
  #handlerRunning = false
  /** An error answered the request while the handler was still running. */
  #interrupted = false
  #handlerReturned: Array<(outcome: HandlerOutcome) => void> | null = null

  constructor (private readonly state: RequestState) {}

  get phase (): Phase { return this.#phase }
  /** The owner's lease (set from `own` on). */
  get lease (): Lease | null { return this.#lease }
  /** Atomic mode: the lease holds an open transaction (committed by complete, rolled back by release). */
  get transactional (): boolean { return this.#transactional }

  /** parsed → owner. Lease mode: renewal starts. */
  own (engine: Engine, result: ClaimAcquired): void {
    this.#phase = 'owner'
    this.#lease = result.lease
    this.#engine = engine
    this.#transactional = result.transaction !== undefined
    if (!this.#transactional) {
      this.#ownedAt = performance.now()
      this.#schedule()
    }
  }

  replayed (): void { this.#phase = 'replayed' }
  answered (): void { this.#phase = 'answered' }
  unprotected (): void { this.#phase = 'unprotected' }

  /**
   * The client went away (its socket closed before the response ended, or timed out). Lease mode:
   * nothing changes, the handler runs on and its outcome is recorded for the retry. Atomic mode:
   * owner → settling, and the caller rolls back now. Returns true when the caller must roll back.
   */
  clientLeft (): boolean {
    if (this.#phase !== 'owner' || !this.#transactional) return false
    this.#phase = 'settling'
    return true
  }

  /** onSend: the owner's answer (owner → settling), or a payload to pass or drop. */
  respond (): Response {
    if (this.#phase === 'owner') {
      this.#phase = 'settling'
      this.#responding = true
      return 'settle'
    }
    return this.#responding ? 'duplicate' : 'pass'
  }

  /** The owner's onSend handed its payload back to Fastify: a later onSend is Fastify's own (an error page). */
  responded (): void { this.#responding = false }

  /** onResponse without onSend (reply.hijack(), a raw write): owner → settling. False when not the owner. */
  unsent (): boolean {
    if (this.#phase !== 'owner') return false
    this.#phase = 'settling'
    return true
  }

  /** settling → settled: the store answered (or the settlement gave up). Renewal stops; local waiters wake. */
  settled (): void {
    this.#phase = 'settled'
    this.#stopRenewal()
    this.#engine?.waiters.notify(localId(this.state.scope, this.state.key))
  }

  handlerStarted (): void { this.#handlerRunning = true }

  handlerReturned (outcome: HandlerOutcome): void {
    this.#handlerRunning = false
    const waiting = this.#handlerReturned
    this.#handlerReturned = null
    if (waiting !== null) for (const resume of waiting) resume(outcome)
  }

  /**
   * onError: an error reached the request. While the handler is still running, that error is not
   * the handler's own (those arrive once it has thrown or rejected): something answered for it
   * (Fastify's handlerTimeout), and the handler may still produce its effect.
   */
  failed (): void {
    if (this.#handlerRunning && !this.#transactional) this.#interrupted = true
  }

  /**
   * Null when a failure can be settled now; otherwise (the answer interrupted a handler that still
   * runs) a promise of how the handler ended, once it has.
   */
  interruptedHandler (): Promise<HandlerOutcome> | null {
    if (!this.#interrupted || !this.#handlerRunning) return null
    return new Promise((resolve) => { (this.#handlerReturned ??= []).push(resolve) })
  }

  /**
   * Proves, with a fenced store call, that this request still owns its key, and extends its lease
   * (recovery points call it right before running a step, so a step never runs in an owner that was
   * taken over). False when the key was lost; a store failure propagates (nothing may run unproven).
   *
   * The renewal's lease runs from when the store applied it, which is no earlier than when it was
   * sent: an answer back within one lease of sending proves the lease still holds now. A later
   * answer proves nothing (the lease it granted may have lapsed and been taken over meanwhile), so
   * it counts as a store failure, like no answer within the lease.
   */
  async fence (): Promise<boolean> {
    const lease = this.#lease
    const engine = this.#engine
    if (this.#lost || lease === null || engine === null) return false
    const settings = this.state.settings
    const sent = performance.now()
    const owned = await withTimeout('renew', Math.min(settings.storeTimeout, settings.lease), () => engine.store.renew(lease, settings.lease))
    if (!owned) {
      this.#lose()
      return false
    }
    // A timer can fire late (a blocked event loop): the answer may be older than the lease anyway.
    if (performance.now() - sent >= settings.lease) throw new StoreTimeoutError('renew', settings.lease)
    return true
  }

  #schedule (): void {
    const settings = this.state.settings
    if (settings.maxOwnership > 0 && performance.now() - this.#ownedAt >= settings.maxOwnership) {
      observe(this.#engine?.metrics ?? null, this.state, 'ownership_expired', 'warn',
        `idempotency: the owner held its key for maxOwnership (${settings.maxOwnership} ms) and still runs; its lease is no longer renewed, so a retry may take the key over once it lapses`)
      return
    }
    renewals(Math.max(1, Math.floor(settings.lease / 3))).add(this)
  }

  /** The schedule's renewal: a store failure keeps it going (a blip must not hand a running owner's key to a retry). */
  async renewOnSchedule (): Promise<void> {
    if (!this.#holding() || this.#renewing) return
    this.#renewing = true
    const engine = this.#engine as Engine
    const lease = this.#lease as Lease
    const settings = this.state.settings
    try {
      const owned = await withTimeout('renew', settings.storeTimeout, () => engine.store.renew(lease, settings.lease))
      if (!owned) {
        this.#lose()
        return
      }
    } catch (err) {
      if (this.#holding()) observe(engine.metrics, this.state, 'store_error', 'warn', 'idempotency: lease renewal failed; retrying at the next interval', err)
    } finally {
      this.#renewing = false
    }
    if (this.#holding()) this.#schedule()
  }

  /** Still the key's owner, with its outcome not yet settled: the lease must be kept. */
  #holding (): boolean {
    return (this.#phase === 'owner' || this.#phase === 'settling') && !this.#lost
  }

  /**
   * A renewal was refused. Reported only while the handler runs: once settling, the refusal may just
   * be the settlement winning the race (the record completed), and the settlement's own store answer
   * says whether the key was really lost.
   */
  #lose (): void {
    if (this.#phase === 'settled') return
    this.#lost = true
    this.#stopRenewal()
    if (this.#phase === 'owner') {
      observe(this.#engine?.metrics ?? null, this.state, 'lease_lost', 'warn', 'idempotency: lease lost to another attempt; this response will not be recorded')
    }
  }

  #stopRenewal (): void {
    if (this.scheduled) renewals(Math.max(1, Math.floor(this.state.settings.lease / 3))).remove(this)
  }
}
