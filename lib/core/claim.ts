import type { RequestState } from './context.js'
import { SealedResponseError } from './encryption.js'
import type { Engine } from './engine.js'
import { StoreTimeoutError } from './errors.js'
import { keyedFingerprint, matchFingerprint, UNVERIFIABLE } from './fingerprint-keys.js'
import { observe } from './observe.js'
import { giveBack } from './outcome.js'
import { clearInFlight, consultPrefilter, markInFlight, rememberCompleted } from './prefiltering.js'
import { RequestContext } from './recovery.js'
import type { Answer, ClaimAcquired, ClaimCompleted, ClaimInProgress, ClaimRequest, ClaimResult, Fingerprint, StoredResponse } from './store.js'
import { isThenable } from './thenable.js'
import { bounded, boundedPromise } from './timeout.js'
import { localId, type Follower } from './waiters.js'

/*
 * The claim, for every door: the store (and, before it, the pre-filter) decides whether this
 * attempt runs the operation, gets the recorded outcome, or is refused. An adapter (the Fastify
 * hooks, the job runner) computes the scope and the unkeyed fingerprint, calls `claimKey`, and
 * turns the decision into its own answer: a reply, a value, an error.
 */

/** What the claim decided. `run`: this attempt owns the key, `state.context` is its operation. */
export type Decision =
  | { readonly kind: 'run' }
  /** Another answer went out while the claim was in flight (a handlerTimeout): nothing runs. */
  | { readonly kind: 'preempted' }
  /** The operation completed earlier: its recorded outcome (draft §2.6). */
  | { readonly kind: 'replay', readonly response: StoredResponse }
  /** Another attempt holds the key (draft §2.7: 409). */
  | { readonly kind: 'in-progress' }
  /** The key was used for another request (draft §2.7: 422). */
  | { readonly kind: 'mismatch' }
  /** The store failed, timed out, or holds a record this process cannot verify: nothing ran. */
  | { readonly kind: 'unavailable' }
  /** The store failed and `onStoreError: 'bypass'` runs the operation without protection. */
  | { readonly kind: 'bypass' }

const RUN: Decision = Object.freeze({ kind: 'run' })
const PREEMPTED: Decision = Object.freeze({ kind: 'preempted' })
const IN_PROGRESS: Decision = Object.freeze({ kind: 'in-progress' })
const MISMATCH: Decision = Object.freeze({ kind: 'mismatch' })
const UNAVAILABLE: Decision = Object.freeze({ kind: 'unavailable' })
const BYPASS: Decision = Object.freeze({ kind: 'bypass' })

/** Polling of a store for an in-flight original owned by another process: 10 ms, doubling to 250 ms. */
const FIRST_POLL_MS = 10
const MAX_POLL_MS = 250
/** Past the lease's end as the store reported it, so the next read finds it lapsed rather than a millisecond short. */
const LAPSE_MARGIN_MS = 20
/** While settlement notices flow: the longest a waiter goes without reading the record, in case its notice was lost. */
const NOTICED_POLL_MS = 2_000

/**
 * Claims `state.key` in `state.scope` for the request whose unkeyed fingerprint is `unkeyed`.
 * Synchronous from end to end when the store answers directly (the memory store) and there is no
 * pre-filter, no wait and no transaction: the embedded default pays no promise for it.
 */
export function claimKey (engine: Engine, state: RequestState, unkeyed: Fingerprint): Decision | Promise<Decision> {
  state.unkeyedFingerprint = unkeyed
  // With `encryption`, keyed (lib/core/fingerprint-keys.ts), so the store never holds a guessable
  // hash of the request; the unkeyed one stays with the state, to recognise records made under an older key.
  const fingerprint = engine.fingerprintKeys === null ? unkeyed : keyedFingerprint(engine.fingerprintKeys, unkeyed)
  return claimFor(engine, state, fingerprint)
}

/** The request's fingerprint: exposed as the operation's `fingerprint`, and what its claim carries. */
function useFingerprint (engine: Engine, state: RequestState, fingerprint: Fingerprint): void {
  state.context = new RequestContext(state.key, state.scope, fingerprint, engine, state)
}

/**
 * A record made for this request under another spelling of its fingerprint (an older key still in
 * the ring, or the unkeyed one from before encryption), found in progress: the request takes the
 * record's spelling (so the store, which compares fingerprints byte for byte, hands a lapsed lease
 * over to it) and claims again, once. Null when there is nothing to adopt: the record's
 * fingerprint is the request's own, another request's (422), or unverifiable (503).
 */
function adoptRotated (engine: Engine, state: RequestState, held: ClaimInProgress | ClaimCompleted, fingerprint: Fingerprint): Fingerprint | null {
  if (held.outcome !== 'in_progress' || state.adoptedFingerprint || held.fingerprint.algorithm === fingerprint.algorithm) return null
  const matched = matchOf(engine, state, held.fingerprint, fingerprint)
  if (matched === null || matched === UNVERIFIABLE) return null
  state.adoptedFingerprint = true
  useFingerprint(engine, state, matched)
  return matched
}

function claimFor (engine: Engine, state: RequestState, fingerprint: Fingerprint): Decision | Promise<Decision> {
  const settings = state.settings
  useFingerprint(engine, state, fingerprint)
  const claim: ClaimRequest = { scope: state.scope, key: state.key, fingerprint, leaseMs: settings.lease, ttlMs: settings.ttl, announce: settings.wait > 0 }
  if (claim.announce === true) engine.waiters.watch()
  if (engine.prefilter !== null || settings.wait > 0 || settings.transaction) return claimLoop(engine, state, claim)
  // One store call. A store that answers directly (the memory store) is decided on at once, with no
  // promise: the embedded default's whole claim stays synchronous.
  const askedAt = performance.now()
  let answer: Answer<ClaimResult>
  try {
    answer = engine.store.claim(claim)
  } catch (err) {
    return storeFailed(engine, state, err)
  }
  if (!isThenable(answer)) return claimed(engine, state, fingerprint, answer, null)
  return boundedPromise('claim', settings.storeTimeout, answer, giveBackLate(engine, state)).then(
    (result) => claimed(engine, state, fingerprint, result, askedAt),
    (err: unknown) => storeFailed(engine, state, err)
  )
}

/** The store's answer to one claim, without a pre-filter or a wait: run, replay, 422 or 409. */
function claimed (engine: Engine, state: RequestState, fingerprint: Fingerprint, result: ClaimResult, askedAt: number | null): Decision | Promise<Decision> {
  if (result.outcome === 'acquired') return acquired(engine, state, result, askedAt)
  const adopted = adoptRotated(engine, state, result, fingerprint)
  if (adopted !== null) return claimFor(engine, state, adopted)
  return decideHeld(engine, state, result, fingerprint) ?? refuseInProgress(engine, state)
}

/**
 * The store handed the key over: the lifecycle says whether this request can still use it. Not when
 * another answer went out while the claim was in flight (a handlerTimeout: the handler never runs),
 * nor when the answer came back too late in its lease (lib/core/lifecycle.ts, `landed`): the key is
 * given back at once, so no retry waits a lease for it (lib/core/outcome.ts, `giveBack`).
 */
function acquired (engine: Engine, state: RequestState, result: ClaimAcquired, askedAt: number | null): Decision {
  switch (state.lifecycle.landed(engine, result, askedAt)) {
    case 'own':
      becomeOwner(engine, state, result)
      return RUN
    case 'preempted':
      giveBack(engine, state, result, 'landed after another answer went out')
      return PREEMPTED
    case 'stale':
      giveBack(engine, state, result, 'came back too late in its lease')
      return storeFailed(engine, state, new StoreTimeoutError('claim', state.settings.lease))
  }
}

/**
 * The claim with a pre-filter, a `wait`, or in atomic mode. The pre-filter answers only from a
 * completed copy, which is the store's committed record; an in-flight marker is not the store's word
 * (it may be older than the store's answer, or this very request's: lib/core/prefilter.ts), so it
 * never answers: while the route may wait, it is a reason to wait without asking the store, and the
 * store is asked before any answer is given.
 */
async function claimLoop (engine: Engine, state: RequestState, claim: ClaimRequest): Promise<Decision> {
  const wait = state.preferredWait === null ? state.settings.wait : Math.min(state.preferredWait, state.settings.wait)
  // Followed from before the first claim: a settlement between the store's answer and the wait is kept for the wait.
  const follower = wait > 0 ? engine.waiters.follow(localId(state.scope, state.key)) : null
  try {
    return await claimRounds(engine, state, claim, wait, follower)
  } finally {
    follower?.end()
  }
}

async function claimRounds (engine: Engine, state: RequestState, claim: ClaimRequest, wait: number, follower: Follower | null): Promise<Decision> {
  const settings = state.settings
  let fingerprint = claim.fingerprint
  const deadline = wait > 0 ? Date.now() + wait : 0
  let poll = FIRST_POLL_MS
  /** Woken by a settlement of the key: in atomic mode, the record is read before any claim (readSettled). */
  let woken = false
  for (let round = 0; ; round++) {
    let held: ClaimInProgress | ClaimCompleted
    // Markers only matter to duplicates that wait: a route that does not wait sets none. Woken by a
    // settlement, a duplicate that still finds the marker asks the store: the pre-filter's copy of
    // the outcome may not be written yet.
    const hit = engine.prefilter === null ? null : await consultPrefilter(engine, state, fingerprint, round === 0 && settings.wait > 0)
    if (hit?.state === 'completed') {
      held = { outcome: 'completed', fingerprint: hit.fingerprint, response: hit.response }
    } else if (follower !== null && hit?.state === 'in_progress' && !woken && deadline - Date.now() > 0 && isFingerprint(matchOf(engine, state, hit.fingerprint, fingerprint))) {
      // A marker says nothing of the owner's lease: while notices flow, the settlement wakes it.
      const remaining = deadline - Date.now()
      woken = await follower.wait(engine.waiters.live ? Math.min(remaining, NOTICED_POLL_MS) : Math.min(poll, remaining))
      poll = Math.min(poll * 2, MAX_POLL_MS)
      continue
    } else {
      const asked = Date.now()
      const askedAt = performance.now()
      let result: ClaimResult
      try {
        const settled = woken && settings.transaction ? await readSettled(engine, state) : null
        const ask = settings.transaction ? () => claimInTransaction(engine, claim) : () => engine.store.claim(claim)
        if (settled !== null) {
          result = settled
        } else if (follower !== null) {
          result = await sharedClaim(engine, state, claim, ask)
        } else {
          result = await bounded('claim', settings.storeTimeout, ask, giveBackLate(engine, state))
        }
      } catch (err) {
        if (state.markedInFlight) clearInFlight(engine, state)
        return storeFailed(engine, state, err)
      }
      if (result.outcome === 'acquired') return acquired(engine, state, result, settings.transaction ? null : askedAt)
      // The storm's next duplicates can then be answered without the store. The copy replaces the
      // marker the first look may have set; without a copy, that marker (this request's, and this
      // request does not own the key) goes.
      const copied = result.outcome === 'completed' && result.expiresInMs !== undefined &&
        rememberCompleted(engine, state, result.fingerprint, result.response, result.expiresInMs, asked)
      if (!copied && state.markedInFlight) clearInFlight(engine, state)
      held = result
    }

    const adopted = adoptRotated(engine, state, held, fingerprint)
    if (adopted !== null) {
      // Claimed again at once, with the record's spelling of the fingerprint.
      fingerprint = adopted
      claim = { ...claim, fingerprint }
      continue
    }
    const decided = decideHeld(engine, state, held, fingerprint)
    if (decided !== null) return decided
    const remaining = deadline - Date.now()
    if (follower === null || remaining <= 0) return refuseInProgress(engine, state)
    woken = await follower.wait(pauseFor(engine, held as ClaimInProgress, poll, remaining))
    poll = Math.min(poll * 2, MAX_POLL_MS)
  }
}

/**
 * How long a duplicate waits before it reads the record again, unless woken first. While the
 * store's settlement notices flow, the original's settlement wakes it (lib/core/waiters.ts), so it
 * reads again only then; or once the original's lease has lapsed (an owner that died settles
 * nothing; one still running has renewed by then, and the duplicate waits again); or after
 * NOTICED_POLL_MS, for a notice that never came (a process that died between its settlement and
 * the notice, a connection pooler that does not pass notices on). Otherwise it polls: 10 ms,
 * doubling to 250 ms.
 */
function pauseFor (engine: Engine, held: ClaimInProgress, poll: number, remaining: number): number {
  if (!engine.waiters.live) return Math.min(poll, remaining)
  const untilLapse = held.leaseRemainingMs > 0 ? held.leaseRemainingMs + LAPSE_MARGIN_MS : Infinity
  return Math.min(remaining, untilLapse, NOTICED_POLL_MS)
}

/**
 * Atomic mode, woken by a settlement of the key: most often the original committed its response,
 * which one read answers; a claim in a transaction costs several statements and a pooled
 * connection for a moment. Null when the record is not completed (released, held, expired or not
 * yet visible): the caller claims.
 */
async function readSettled (engine: Engine, state: RequestState): Promise<ClaimCompleted | null> {
  const { answer } = engine.sharedCalls.run(`get\n${localId(state.scope, state.key)}`,
    () => bounded('claim', state.settings.storeTimeout, () => engine.store.get({ scope: state.scope, key: state.key }), () => {}))
  const record = await answer
  return record?.state === 'completed' ? { outcome: 'completed', fingerprint: record.fingerprint, response: record.response } : null
}

/**
 * Another attempt holds the key: a mismatch for a different request, the replay of a completed one,
 * or null while it is in progress (the caller waits or refuses).
 */
function decideHeld (engine: Engine, state: RequestState, held: ClaimInProgress | ClaimCompleted, fingerprint: Fingerprint): Decision | null {
  // Draft §2.7: a key reused with a different request is a client error whatever the state of the
  // original, so 422 is checked before 409 (the client must correct the request either way).
  const matched = matchOf(engine, state, held.fingerprint, fingerprint)
  if (matched === UNVERIFIABLE) {
    // Never a bypass, whatever onStoreError says: the record exists, so running would run twice.
    observe(engine.metrics, state, 'store_error', 'error', 'idempotency: the record\'s fingerprint was made under a key id that is not in the encryption keys (removed before its records expired, or encryption turned off); the operation did not run (503)')
    state.lifecycle.answered()
    return UNAVAILABLE
  }
  if (matched === null) {
    observe(engine.metrics, state, 'mismatch', 'info', 'idempotency: key reused with a different request')
    state.lifecycle.answered()
    return MISMATCH
  }
  return held.outcome === 'completed' ? { kind: 'replay', response: held.response } : null
}

/**
 * Whether `stored` was made for this request (lib/core/fingerprint-keys.ts): the same fingerprint, the
 * request's under an older key still in the ring, or its unkeyed one for a record made before
 * encryption was enabled; null for another request; UNVERIFIABLE for a key no longer in the ring.
 */
function matchOf (engine: Engine, state: RequestState, stored: Fingerprint, fingerprint: Fingerprint): ReturnType<typeof matchFingerprint> {
  return matchFingerprint(engine.fingerprintKeys, fingerprint, state.unkeyedFingerprint ?? fingerprint, stored)
}

function isFingerprint (matched: ReturnType<typeof matchFingerprint>): matched is Fingerprint {
  return matched !== null && matched !== UNVERIFIABLE
}

function refuseInProgress (engine: Engine, state: RequestState): Decision {
  observe(engine.metrics, state, 'conflict', 'info', 'idempotency: original request still in progress')
  state.lifecycle.answered()
  return IN_PROGRESS
}

/** The store handed the key to this request: it executes, holding the key until it settles. */
function becomeOwner (engine: Engine, state: RequestState, result: ClaimAcquired): void {
  if (result.takeover) observe(engine.metrics, state, 'taken_over', 'warn', 'idempotency: took over an in-progress key whose owner stopped renewing its lease')
  else observe(engine.metrics, state, 'executed', 'debug', 'idempotency: key claimed')
  const context = state.context as RequestContext
  if (state.settings.wait > 0) markInFlight(engine, state, context.fingerprint)
  // Atomic mode: the open transaction holds the record, and a crash rolls it back.
  if (result.transaction !== undefined) context.sql = result.transaction
}

/**
 * A waiting duplicate's claim, joined to the claim of the same key another waiting duplicate of this
 * process has in flight, if any (lib/core/shared-calls.ts). A joined claim that acquired the key is
 * that duplicate's to run: this one then asks for itself.
 */
async function sharedClaim (engine: Engine, state: RequestState, claim: ClaimRequest, ask: () => Answer<ClaimResult>): Promise<ClaimResult> {
  const settings = state.settings
  const call = (): Answer<ClaimResult> => bounded('claim', settings.storeTimeout, ask, giveBackLate(engine, state))
  const { answer, own } = engine.sharedCalls.run(`${settings.transaction ? 'claimInTransaction' : 'claim'}\n${localId(state.scope, state.key)}`, call)
  const joined = await answer
  if (own) return joined
  switch (joined.outcome) {
    case 'in_progress':
      // Unseen: the record in the way could not be read, and the fingerprint is the asker's, not its.
      return joined.unseen === true ? { ...joined, fingerprint: claim.fingerprint } : joined
    case 'completed':
      // Without its retention: counted from the asker's call, which this one did not time, it could
      // let a pre-filter copy outlive the record. The asker copies it.
      return { outcome: 'completed', fingerprint: joined.fingerprint, response: joined.response }
    case 'acquired':
      return await call()
  }
}

/** A claim that lands after its storeTimeout was answered (503, an error, or a bypass): given back at once. */
function giveBackLate (engine: Engine, state: RequestState) {
  return (result: ClaimResult): void => {
    if (result.outcome === 'acquired') giveBack(engine, state, result, 'landed after storeTimeout')
  }
}

function claimInTransaction (engine: Engine, claim: ClaimRequest): Promise<ClaimResult> {
  const store = engine.store
  // Checked when the route was added; kept for stores that drop the method at run time.
  if (store.claimInTransaction === undefined) return Promise.reject(new TypeError('fastify-idempotency: the store has no claimInTransaction'))
  return store.claimInTransaction(claim)
}

function storeFailed (engine: Engine, state: RequestState, err: unknown): Decision {
  // A record that cannot be opened (encryption: unknown key id, tampering) is not an outage: the
  // store answered, and the record says the operation ran, so bypassing would run it a second time.
  if (state.settings.onStoreError === 'bypass' && !(err instanceof SealedResponseError)) {
    state.lifecycle.unprotected()
    observe(engine.metrics, state, 'bypassed', 'error', 'idempotency: store failed; running the handler WITHOUT idempotency protection (onStoreError: bypass)', err)
    return BYPASS
  }
  observe(engine.metrics, state, 'store_error', 'error', 'idempotency: store failed; the operation did not run (503)', err)
  state.lifecycle.answered()
  return UNAVAILABLE
}
