import type { Engine } from './engine.js'
import { StoreTimeoutError } from './errors.js'
import { observe, type Observed } from './observe.js'
import { schedules, type Scheduled } from './schedule.js'
import type { CoreSettings } from './settings.js'
import type { ClaimAcquired, Lease } from './store.js'
import { bounded } from './timeout.js'
import { localId } from './waiters.js'

/*
 * The lifecycle of one protected request: its phase, what keeps its key, and the key's fate. Every
 * change of phase, every start or stop of the lease's renewal and every decision between recording,
 * releasing and holding the key is taken in this file; the hooks, the claim and the settling code
 * report what happened and act on what it answers. The flags behind those decisions are private here.
 *
 * A lease exists to detect a DEAD owner (a record stuck in progress because its process crashed must
 * become claimable again), not a departed client, a slow consumer or a store that failed for a
 * moment. A live owner keeps its key until its outcome is written. So, in lease mode, the lease is
 * renewed every lease/3 from the claim until the store has settled the key (recorded the response,
 * released the key or held it for the reconciler), whatever the client does meanwhile and however
 * often the store fails meanwhile. Renewal stops, and the key can then be taken over once its lease
 * lapses, only when:
 *   - the store settled the key (phase `settled`);
 *   - the store refused a renewal or a settlement: another attempt owns the key now (`lost`);
 *   - the route's `maxOwnership` elapsed while this owner still held the key (an explicit bound on
 *     stuck handlers, off by default);
 *   - the process died (no timer runs any more), or the store was unreachable for a whole lease.
 * Atomic mode has no lease to renew: the open transaction holds the record, and a crash rolls it back.
 *
 * Phases:
 *
 * | phase          | transition (reported by)                                  | next        | the lease (lease mode)         |
 * |----------------|-----------------------------------------------------------|-------------|--------------------------------|
 * | parsed         | the store handed over the key (claim)                     | owner       | renewal starts                 |
 * | parsed         | an answer that is not the claim's went out (onSend/onError)| preempted   | a claim that lands is given back |
 * | parsed         | replayed / answered / unprotected (claim)                 | that phase  | none was taken                 |
 * | owner          | clientLeft: the socket closed, onTimeout                  | owner       | kept: renewal goes on          |
 * | owner (atomic) | clientLeft                                                | settling    | the transaction is rolled back |
 * | owner          | respond: the answer reaches onSend                        | settling    | kept until the store settles   |
 * | owner          | unsent: onResponse without onSend (hijack)                | settling    | kept until the store settles   |
 * | settling       | settled: the store answered                               | settled     | renewal stops, waiters wake    |
 * | owner/settling | the store refused a renewal or a settlement               | unchanged   | renewal stops (`lost`)         |
 * | owner/settling | maxOwnership elapsed                                      | unchanged   | renewal stops, the lease lapses|
 *
 * The handler runs only in `owner` (and unprotected, after a bypass): an answer that went out before
 * it started (a handlerTimeout, a later preHandler's reply) leaves it unrun, so nothing executes
 * beside a key that is being released.
 *
 * The key's fate, once the answer is known (`fate`):
 *
 * | what happened                                                                  | lease mode                   | atomic mode |
 * |--------------------------------------------------------------------------------|------------------------------|-------------|
 * | the handler answered, and the route's `record` rule records the status        | record                       | record (commit) |
 * | the handler answered, and the `record` rule threw                              | record (the answer the client gets) | record |
 * | the handler answered, and the `record` rule does not record the status        | failure (below)              | release (roll back) |
 * | the answer cannot be recorded or sent as produced (a payload type that cannot be | hold (release after markDefinite()): the handler returned, its effect may have happened | release |
 * |   recorded, a header Node refuses, a response stream that failed, an error while settling) | |             |
 * | the handler threw (onError while it ran or after)                              | failure (below)              | release     |
 * | an answer interrupted the running handler (onError before it returned: a handlerTimeout) | after it returns: hold; after it throws: failure | release |
 * | an answer went out before the handler started (onError, a hook's reply)        | failure (below)              | release     |
 * | the response bypassed onSend (reply.hijack(), a raw write)                     | release (concurrency protection only) | release |
 * | failure: markDefinite(), or no step completed                                  | release                      |             |
 * | failure: markIndeterminate(), or a step completed                              | hold                         |             |
 *
 * Store failures (outcome.ts carries them out):
 *
 * | store call fails or times out | what follows |
 * |-------------------------------|--------------|
 * | claim                         | nothing is owned: 503 (or bypass); a claim that lands later is given back at once |
 * | claim answered with less than a renewal interval of its lease left, or after an answer already went out | given back at once (release; a takeover's lease is given up, keeping its steps; atomic: roll back) |
 * | complete, hold                | tried again with backoff while renewal goes on, the answer going out after the first tries, until the store answers |
 * | release                       | tried again briefly; then the lease lapses on its own (nothing ran that a retry could repeat) |
 * | renew                         | tried again at the next interval; the key is lost only if no renewal lands for a whole lease |
 */

/** What a lifecycle needs of its request (lib/core/context.ts, RequestState): what it reports, and its timing. */
export interface LifecycleSubject extends Observed {
  readonly settings: CoreSettings
}

/** Where a protected request stands. */
export type Phase = 'parsed' | 'owner' | 'settling' | 'settled' | 'replayed' | 'answered' | 'unprotected' | 'preempted'

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

/** What is done with the key once the answer is known. */
export type Fate = 'record' | 'release' | 'hold'

/** The owner's answer as settling saw it (the rows of the fate table). */
export type Ending =
  /** The handler answered and its status is recorded (or the `record` rule could not tell: it threw). */
  | 'answered'
  /** The handler answered and the `record` rule does not record its status. */
  | 'not-recorded'
  /** The handler returned, but its answer cannot be recorded or sent as it produced it. */
  | 'unrecordable'
  /** An error answered the request (the handler's, or one that came before or during it). */
  | 'threw'
  /** The response left without passing through onSend. */
  | 'unsent'

/** What a claim that acquired the key is for this request (`landed`). */
export type Landing =
  /** The request owns the key: the handler runs. */
  | 'own'
  /** Another answer went out while the claim was in flight: the handler never runs; give the key back. */
  | 'preempted'
  /** The store answered too late to leave a renewal the time to land within the lease: give the key back, 503. */
  | 'stale'

/** A lease is renewed three times per lease: two renewals in a row may fail before it lapses. */
const renewalInterval = (lease: number): number => Math.max(1, Math.floor(lease / 3))

/** Owners due for a renewal, one schedule per renewal interval (lib/core/schedule.ts). */
const renewals = schedules<Lifecycle>((lifecycle) => {
  lifecycle.renewOnSchedule().catch(/* c8 ignore next: renewOnSchedule catches the store's failures */ () => {})
}, false)

export class Lifecycle implements Scheduled {
  // The renewal schedule's links (lib/core/schedule.ts): the owner waits in it between renewals.
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
  /** The route's handler is running (tracked by the handler wrapper, lib/fastify/hooks.ts). */
  #handlerRunning = false
  /** An error reached the owner's request: its answer is a failure. */
  #threw = false
  /** An error answered the request while the handler was still running. */
  #interrupted = false
  #handlerReturned: Array<(outcome: HandlerOutcome) => void> | null = null
  /** Declared by the handler (markDefinite / markIndeterminate); null leaves it to the steps. */
  #failure: 'definite' | 'indeterminate' | null = null
  /** A step of this operation completed (in this attempt or an earlier one). */
  #stepsCompleted = false

  constructor (private readonly state: LifecycleSubject) {}

  get phase (): Phase { return this.#phase }
  /** The owner's lease (set from `landed` on). */
  get lease (): Lease | null { return this.#lease }
  /** Atomic mode: the lease holds an open transaction (committed by complete, rolled back by release). */
  get transactional (): boolean { return this.#transactional }
  /** An error reached the owner's request: settling treats the answer as a failure. */
  get threw (): boolean { return this.#threw }
  /** The store refused a renewal or a settlement: another attempt owns the key. */
  get lost (): boolean { return this.#lost }

  /**
   * The store handed the key to this request. `askedAt` (performance.now() when the claim was sent)
   * is given when the answer came through a promise. A lease runs from when the store applied the
   * claim, no earlier than when it was sent, so it is certain to last until `askedAt + lease`, and
   * no longer: an owner must get a renewal to the store before then. So the claim is used only
   * while at least one renewal interval of that lease is left (otherwise the answer proves too
   * little: the lease may lapse, and another attempt take the key over, before a renewal lands),
   * and renewed at once when less than two intervals are left.
   */
  landed (engine: Engine, result: ClaimAcquired, askedAt: number | null): Landing {
    if (this.#phase === 'preempted') return 'preempted'
    const transactional = result.transaction !== undefined
    const lease = this.state.settings.lease
    const interval = renewalInterval(lease)
    const left = askedAt === null ? lease : askedAt + lease - performance.now()
    if (!transactional && left <= interval) return 'stale'
    this.#phase = 'owner'
    this.#lease = result.lease
    this.#engine = engine
    this.#transactional = transactional
    if (!transactional) {
      this.#ownedAt = performance.now()
      if (left <= 2 * interval) this.renewOnSchedule().catch(/* c8 ignore next: renewOnSchedule catches the store's failures */ () => {})
      else this.#schedule()
    }
    return 'own'
  }

  replayed (): void { this.#phase = 'replayed' }
  answered (): void { this.#phase = 'answered' }
  unprotected (): void { this.#phase = 'unprotected' }

  /** Whether the route's handler may run now: as the key's owner, or unprotected after a bypass. */
  get runsHandler (): boolean { return this.#phase === 'owner' || this.#phase === 'unprotected' }

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

  /**
   * onSend: the owner's answer (owner → settling), or a payload to pass or drop. A payload while the
   * claim is still in flight is someone else's answer (a handlerTimeout, a hook that replied): the
   * handler must not run once the claim lands.
   */
  respond (): Response {
    if (this.#phase === 'owner') {
      this.#phase = 'settling'
      this.#responding = true
      return 'settle'
    }
    if (this.#phase === 'parsed') this.#phase = 'preempted'
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

  /** settling → settled: the store answered (or gave no answer it could act on). Renewal stops; local waiters wake. */
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
   * onError: an error reached the request. While the claim is in flight, it answers for the request
   * (the handler must not run). For the owner, the answer is a failure; while the handler is still
   * running, that error is not the handler's own (those arrive once it has thrown or rejected):
   * something answered for it (Fastify's handlerTimeout), and the handler may still produce its effect.
   */
  errored (): void {
    if (this.#phase === 'parsed') {
      this.#phase = 'preempted'
      return
    }
    if (this.#phase !== 'owner') return
    this.#threw = true
    if (this.#handlerRunning && !this.#transactional) this.#interrupted = true
  }

  /** markDefinite / markIndeterminate. */
  declare (failure: 'definite' | 'indeterminate'): void { this.#failure = failure }

  /** A step completed (or an earlier attempt's steps were loaded): from here a failure is indeterminate. */
  stepCompleted (): void { this.#stepsCompleted = true }

  /**
   * The key's fate for the owner's answer (the table above). A promise when the answer interrupted
   * a handler that still runs: its fate waits for how the handler ends, and the answer goes out
   * meanwhile.
   */
  fate (ending: Ending): Fate | Promise<Fate> {
    if (ending === 'answered') return 'record'
    if (this.#transactional) return 'release'
    if (ending === 'unsent') return 'release'
    if (ending === 'unrecordable') return this.#failure === 'definite' ? 'release' : 'hold'
    if (this.#interrupted && this.#handlerRunning) {
      return new Promise<HandlerOutcome>((resolve) => { (this.#handlerReturned ??= []).push(resolve) })
        .then((outcome) => outcome === 'returned' ? 'hold' : this.#failureFate())
    }
    return this.#failureFate()
  }

  /** Whether the answer interrupted a handler that is still running (its fate then waits for it). */
  get interrupting (): boolean { return this.#interrupted && this.#handlerRunning }

  /**
   * A definite failure (nothing happened) releases the key so a retry runs the operation again. An
   * indeterminate one (an external effect may have happened: declared with markIndeterminate(), or
   * the default once a step completed) keeps the record and its steps for the reconciler: releasing
   * it would discard the recovery points and let a retry repeat steps that already took effect.
   */
  #failureFate (): Fate {
    if (this.#failure === 'indeterminate') return 'hold'
    if (this.#failure === null && this.#stepsCompleted) return 'hold'
    return 'release'
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
    const owned = await bounded('renew', Math.min(settings.storeTimeout, settings.lease), () => engine.store.renew(lease, settings.lease))
    if (!owned) {
      this.lose()
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
    renewals(renewalInterval(settings.lease)).add(this)
  }

  /**
   * The schedule's renewal: a store failure keeps it going (a blip must not hand a running owner's
   * key to a retry). Each renewal is bounded by the renewal interval as well as by storeTimeout: a
   * renewal that hangs must not hold back the next one (with a storeTimeout longer than the lease,
   * the lease would lapse while the store was reachable all along).
   */
  async renewOnSchedule (): Promise<void> {
    if (!this.holding || this.#renewing) return
    this.#renewing = true
    const engine = this.#engine as Engine
    const lease = this.#lease as Lease
    const settings = this.state.settings
    try {
      const owned = await bounded('renew', Math.min(settings.storeTimeout, renewalInterval(settings.lease)), () => engine.store.renew(lease, settings.lease))
      if (!owned) {
        this.lose()
        return
      }
    } catch (err) {
      if (this.holding) observe(engine.metrics, this.state, 'store_error', 'warn', 'idempotency: lease renewal failed; retrying at the next interval', err)
    } finally {
      this.#renewing = false
    }
    if (this.holding) this.#schedule()
  }

  /** Still the key's owner, with its outcome not yet settled: the lease must be kept. */
  get holding (): boolean {
    return (this.#phase === 'owner' || this.#phase === 'settling') && !this.#lost
  }

  /**
   * The store refused a renewal or a settlement: another attempt owns the key. Reported here only
   * while the handler runs: once settling, the refusal may just be the settlement winning the race
   * (the record completed), and the settlement's own store answer says whether the key was lost.
   */
  lose (): void {
    if (this.#phase === 'settled') return
    this.#lost = true
    this.#stopRenewal()
    if (this.#phase === 'owner') {
      observe(this.#engine?.metrics ?? null, this.state, 'lease_lost', 'warn', 'idempotency: lease lost to another attempt; this response will not be recorded')
    }
  }

  #stopRenewal (): void {
    if (this.scheduled) renewals(renewalInterval(this.state.settings.lease)).remove(this)
  }
}
