import type { FastifyReply, FastifyRequest } from 'fastify'
import type { IdempotencyContext, RequestState } from './context.js'
import { answer, type Engine } from './engine.js'
import { StoreTimeoutError } from './errors.js'
import { observe } from './observe.js'
import { canonicalFingerprint, customFingerprint, finishRawHash, startRawHash } from './fingerprint.js'
import { CanonicalLimitError } from './fingerprint-canonical.js'
import { keyedFingerprint, matchFingerprint, UNVERIFIABLE } from './fingerprint-keys.js'
import { SealedResponseError } from './encryption.js'
import { replyValue } from './headers.js'
import { RequestContext } from './recovery.js'
import { scopeOf } from './scope.js'
import { isThenable } from './thenable.js'
import { isReference, sendRebuilt } from './reference.js'
import { clearInFlight, consultPrefilter, markInFlight, rememberCompleted } from './prefiltering.js'
import { rollBackForDepartedClient } from './settle.js'
import type { ClaimAcquired, ClaimCompleted, ClaimInProgress, ClaimRequest, ClaimResult, Fingerprint, StoredResponse } from './store.js'
import { withTimeout } from './timeout.js'
import { localId } from './waiters.js'

/** Polling of a store for an in-flight original owned by another process: 10 ms, doubling to 250 ms. */
const FIRST_POLL_MS = 10
const MAX_POLL_MS = 250

/** What the claim decided: undefined, the handler runs; a reply, the request was answered. */
type Claimed = FastifyReply | undefined

/**
 * preHandler: the body is parsed and validated and the caller authenticated, so this is the first
 * point where the request is known to be one the handler would run. Resolves the scope, computes
 * the fingerprint, and lets the store decide: execute (owner), replay, 409, 422. Synchronous from
 * end to end when everything it needs is (a sync scope and fingerprint, a store with synchronous
 * operations, no pre-filter, no wait, lease mode): the embedded default pays no promise for it.
 */
export function claimKey (engine: Engine, request: FastifyRequest, reply: FastifyReply, state: RequestState): Claimed | Promise<Claimed> {
  const scoped = scopeOf(state.settings.scope, request)
  return isThenable(scoped)
    ? Promise.resolve(scoped).then((scope) => claimScoped(engine, request, reply, state, scope))
    : claimScoped(engine, request, reply, state, scoped)
}

function claimScoped (engine: Engine, request: FastifyRequest, reply: FastifyReply, state: RequestState, scope: string): Claimed | Promise<Claimed> {
  state.scope = scope
  let unkeyed: Fingerprint | Promise<Fingerprint>
  try {
    unkeyed = fingerprintOf(request, state)
  } catch (err) {
    if (err instanceof CanonicalLimitError) return refuseBody(engine, reply, state, err)
    throw err
  }
  return isThenable(unkeyed)
    ? Promise.resolve(unkeyed).then((fingerprint) => claimFor(engine, request, reply, state, keyFor(engine, state, fingerprint)))
    : claimFor(engine, request, reply, state, keyFor(engine, state, unkeyed))
}

/**
 * The fingerprint stored for this request: with `encryption`, keyed (lib/fingerprint-keys.ts), so
 * the store never holds a guessable hash of the request; the unkeyed one stays with the request,
 * to recognise records made under an older key.
 */
function keyFor (engine: Engine, state: RequestState, unkeyed: Fingerprint): Fingerprint {
  state.unkeyedFingerprint = unkeyed
  return engine.fingerprintKeys === null ? unkeyed : keyedFingerprint(engine.fingerprintKeys, unkeyed)
}

/** The parsed body is beyond the route's maxBodyDepth or maxBodyNodes: refused before anything is claimed. */
function refuseBody (engine: Engine, reply: FastifyReply, state: RequestState, err: CanonicalLimitError): FastifyReply {
  observe(engine.metrics, state, 'body_refused', 'info', `idempotency: request refused: ${err.message}`)
  return err.limit === 'depth'
    ? answer(engine, state, reply, { kind: 'body-too-deep', extensions: { maxBodyDepth: err.max } })
    : answer(engine, state, reply, { kind: 'body-too-large', extensions: { maxBodyNodes: err.max } })
}

/** The request's fingerprint: exposed as `request.idempotency.fingerprint`, and what its claim carries. */
function useFingerprint (engine: Engine, request: FastifyRequest, state: RequestState, fingerprint: Fingerprint): RequestContext {
  const context = new RequestContext(state.key, state.scope, fingerprint, engine, state)
  state.context = context
  // `sql` (atomic mode) is typed by the Postgres entry point's augmentation of IdempotencyContext.
  request.idempotency = context as IdempotencyContext
  return context
}

/**
 * A record made for this request under another spelling of its fingerprint (an older key still in
 * the ring, or the unkeyed one from before encryption), found in progress: the request takes the
 * record's spelling (so the store, which compares fingerprints byte for byte, hands a lapsed lease
 * over to it) and claims again, once. Null when there is nothing to adopt: the record's
 * fingerprint is the request's own, another request's (422), or unverifiable (503).
 */
function adoptRotated (engine: Engine, request: FastifyRequest, state: RequestState, held: ClaimInProgress | ClaimCompleted, fingerprint: Fingerprint): Fingerprint | null {
  if (held.outcome !== 'in_progress' || state.adoptedFingerprint || held.fingerprint.algorithm === fingerprint.algorithm) return null
  const matched = matchOf(engine, state, held.fingerprint, fingerprint)
  if (matched === null || matched === UNVERIFIABLE) return null
  state.adoptedFingerprint = true
  useFingerprint(engine, request, state, matched)
  return matched
}

function claimFor (engine: Engine, request: FastifyRequest, reply: FastifyReply, state: RequestState, fingerprint: Fingerprint): Claimed | Promise<Claimed> {
  const settings = state.settings
  useFingerprint(engine, request, state, fingerprint)
  const claim: ClaimRequest = { scope: state.scope, key: state.key, fingerprint, leaseMs: settings.lease, ttlMs: settings.ttl }
  const sync = engine.sync
  if (sync !== null && engine.prefilter === null && settings.wait === 0 && !settings.transaction) {
    let result: ClaimResult
    try {
      result = sync.claim(claim)
    } catch (err) {
      return storeFailed(engine, request, reply, state, err)
    }
    if (result.outcome === 'acquired') {
      becomeOwner(engine, reply, state, result)
      return undefined
    }
    const adopted = adoptRotated(engine, request, state, result, fingerprint)
    if (adopted !== null) return claimFor(engine, request, reply, state, adopted)
    return answerHeld(engine, request, reply, state, result, fingerprint) ?? refuseInProgress(engine, reply, state)
  }
  return claimLoop(engine, request, reply, state, claim)
}

/** The claim through the store's promises: with a pre-filter, a `wait` (polling), atomic mode. */
async function claimLoop (engine: Engine, request: FastifyRequest, reply: FastifyReply, state: RequestState, claim: ClaimRequest): Promise<Claimed> {
  const settings = state.settings
  let fingerprint = claim.fingerprint
  const deadline = settings.wait > 0 ? Date.now() + settings.wait : 0
  let poll = FIRST_POLL_MS
  for (let round = 0; ; round++) {
    // What another attempt holds for the key: from the pre-filter when it knows, else from the
    // store, which alone may hand the key to this request. An in-flight marker of another request
    // is left to the store to judge (it may be younger than the store's answer: lib/prefilter.ts).
    let held: ClaimInProgress | ClaimCompleted
    let hit = engine.prefilter === null ? null : await consultPrefilter(engine, state, fingerprint, round === 0)
    if (hit?.state === 'in_progress' && !isFingerprint(matchOf(engine, state, hit.fingerprint, fingerprint))) hit = null
    if (hit !== null) {
      held = hit.state === 'completed'
        ? { outcome: 'completed', fingerprint: hit.fingerprint, response: hit.response }
        : { outcome: 'in_progress', fingerprint: hit.fingerprint, leaseRemainingMs: 0 }
    } else {
      const asked = Date.now()
      const sent = performance.now()
      let result: ClaimResult
      try {
        if (settings.transaction) {
          const waitMs = Math.max(0, deadline - Date.now())
          result = await withTimeout('claim', settings.storeTimeout + waitMs, () => claimInTransaction(engine, claim, waitMs), releaseLate(engine, state))
        } else {
          result = await withTimeout('claim', settings.storeTimeout, () => engine.store.claim(claim), releaseLate(engine, state))
        }
      } catch (err) {
        if (state.markedInFlight) clearInFlight(engine, state)
        return storeFailed(engine, request, reply, state, err)
      }
      if (result.outcome === 'acquired') {
        // The lease runs from when the store applied the claim, no earlier than when it was sent: an
        // answer back after one lease proves nothing (the lease may have lapsed and another attempt
        // taken the key over meanwhile; the chaos harness saw a 728 ms claim under a 300 ms lease
        // start a handler beside the new owner's). Like a renewal answered that late (lifecycle.ts,
        // fence), it counts as a store failure: the key is given back (fenced by the token) and
        // nothing runs. Atomic mode has no lease: its open transaction holds the record.
        if (!settings.transaction && performance.now() - sent >= settings.lease) {
          releaseLate(engine, state)(result)
          if (state.markedInFlight) clearInFlight(engine, state)
          return storeFailed(engine, request, reply, state, new StoreTimeoutError('claim', settings.lease))
        }
        becomeOwner(engine, reply, state, result)
        return undefined
      }
      // The storm's next duplicates can then be answered without the store. The copy replaces the
      // marker the first look may have set; without a copy, that marker (this request's, and this
      // request does not own the key) goes.
      const copied = result.outcome === 'completed' && result.expiresInMs !== undefined &&
        rememberCompleted(engine, state, result.fingerprint, result.response, result.expiresInMs, asked)
      if (!copied && state.markedInFlight) clearInFlight(engine, state)
      held = result
    }

    const adopted = adoptRotated(engine, request, state, held, fingerprint)
    if (adopted !== null) {
      // Claimed again at once, with the record's spelling of the fingerprint.
      fingerprint = adopted
      claim = { ...claim, fingerprint }
      continue
    }
    const answered = answerHeld(engine, request, reply, state, held, fingerprint)
    if (answered !== null) return await answered
    const remaining = deadline - Date.now()
    if (remaining <= 0) return refuseInProgress(engine, reply, state)
    await engine.waiters.wait(localId(state.scope, state.key), Math.min(poll, remaining))
    poll = Math.min(poll * 2, MAX_POLL_MS)
  }
}

/**
 * Another attempt holds the key: 422 for a different request, the replay of a completed one, or
 * null while it is in progress (the caller waits or refuses).
 */
function answerHeld (engine: Engine, request: FastifyRequest, reply: FastifyReply, state: RequestState, held: ClaimInProgress | ClaimCompleted, fingerprint: Fingerprint): FastifyReply | Promise<FastifyReply> | null {
  // Draft §2.7: a key reused with a different request is a client error whatever the state of the
  // original, so 422 is checked before 409 (the client must correct the request either way).
  const matched = matchOf(engine, state, held.fingerprint, fingerprint)
  if (matched === UNVERIFIABLE) {
    // Never a bypass, whatever onStoreError says: the record exists, so running would run twice.
    observe(engine.metrics, state, 'store_error', 'error', 'idempotency: the record\'s fingerprint was made under a key id that is not in the encryption keys (removed before its records expired, or encryption turned off); answering 503')
    return answer(engine, state, reply, { kind: 'store-unavailable', retryAfter: state.settings.retryAfter })
  }
  if (matched === null) {
    observe(engine.metrics, state, 'mismatch', 'info', 'idempotency: key reused with a different request')
    return answer(engine, state, reply, { kind: 'key-reused' })
  }
  return held.outcome === 'completed' ? replay(engine, request, reply, state, held.response) : null
}

/**
 * Whether `stored` was made for this request (lib/fingerprint-keys.ts): the same fingerprint, the
 * request's under an older key still in the ring, or its unkeyed one for a record made before
 * encryption was enabled; null for another request; UNVERIFIABLE for a key no longer in the ring.
 */
function matchOf (engine: Engine, state: RequestState, stored: Fingerprint, fingerprint: Fingerprint): ReturnType<typeof matchFingerprint> {
  return matchFingerprint(engine.fingerprintKeys, fingerprint, state.unkeyedFingerprint ?? fingerprint, stored)
}

function isFingerprint (matched: ReturnType<typeof matchFingerprint>): matched is Fingerprint {
  return matched !== null && matched !== UNVERIFIABLE
}

function refuseInProgress (engine: Engine, reply: FastifyReply, state: RequestState): FastifyReply {
  observe(engine.metrics, state, 'conflict', 'info', 'idempotency: original request still in progress')
  return answer(engine, state, reply, { kind: 'request-in-progress', retryAfter: state.settings.retryAfter })
}

/** The store handed the key to this request: it executes, holding the key until it settles. */
function becomeOwner (engine: Engine, reply: FastifyReply, state: RequestState, result: ClaimAcquired): void {
  state.lifecycle.own(engine, result)
  if (result.takeover) observe(engine.metrics, state, 'taken_over', 'warn', 'idempotency: took over an in-progress key whose owner stopped renewing its lease')
  else observe(engine.metrics, state, 'executed', 'debug', 'idempotency: key claimed')
  const context = state.context as RequestContext
  markInFlight(engine, state, context.fingerprint)
  if (result.transaction !== undefined) {
    // Atomic mode: the open transaction holds the record, and a crash rolls it back.
    context.sql = result.transaction
    // A client that leaves while the handler runs: Node emits the request's 'close' as soon as its
    // body is read, so onRequestAbort misses it; the response closing before its end does not.
    // A client that left while the claim waited (for a pool connection, or on another attempt's
    // lock) closed its response before this listener existed: roll back now, as if it had left
    // while the handler ran; the key is free for its retry.
    const res = reply.raw
    if (res.closed && !res.writableFinished) rollBackForDepartedClient(engine, state)
    else res.once('close', () => { if (!res.writableFinished) rollBackForDepartedClient(engine, state) })
  }
}

/** A claim that lands after its timeout, or after its lease, was answered 503 (or bypassed): give the key back at once. */
function releaseLate (engine: Engine, state: RequestState) {
  return (result: ClaimResult): void => {
    if (result.outcome !== 'acquired') return
    if (result.takeover && result.transaction === undefined) {
      // Lease mode: a takeover holds the record of an operation that may have run partly (its
      // recorded steps): releasing it would delete them, and a retry would repeat those effects.
      // Left alone, its lease lapses within one lease and the next retry takes it over with its
      // steps. (Atomic mode's release is a ROLLBACK, which undoes the takeover and keeps the record,
      // and must be sent: the transaction holds a connection and the row's lock.)
      observe(engine.metrics, state, 'store_error', 'warn', 'idempotency: a takeover landed after storeTimeout or after its lease; left to lapse so that its recorded steps stay')
      return
    }
    engine.store.release(result.lease).then(
      (released) => {
        if (released) observe(engine.metrics, state, 'released', 'warn', 'idempotency: released a claim that landed after storeTimeout or after its lease')
        else observe(engine.metrics, state, 'lease_lost', 'warn', 'idempotency: a claim landed after storeTimeout or after its lease and was taken over before it could be released')
      },
      (err: unknown) => observe(engine.metrics, state, 'store_error', 'error', 'idempotency: could not release a late claim; it frees itself when its lease expires', err)
    )
  }
}

function claimInTransaction (engine: Engine, claim: ClaimRequest, waitMs: number): Promise<ClaimResult> {
  const store = engine.store
  // Checked when the route was added; kept for stores that drop the method at run time.
  if (store.claimInTransaction === undefined) return Promise.reject(new TypeError('fastify-idempotency: the store has no claimInTransaction'))
  return store.claimInTransaction({ ...claim, waitMs })
}

/** The unkeyed fingerprint; synchronous but for a custom function that returns a promise. */
function fingerprintOf (request: FastifyRequest, state: RequestState): Fingerprint | Promise<Fingerprint> {
  const mode = state.settings.fingerprint
  switch (mode.mode) {
    case 'canonical':
      return canonicalFingerprint(request.method, request.url, request.body, request.headers['content-type'], state.settings.bodyLimits)
    case 'raw':
      return finishRawHash(state.rawHash ?? startRawHash(request.method, request.url))
    case 'custom': {
      const value = mode.fn(request)
      return isThenable(value) ? Promise.resolve(value).then(customOf) : customOf(value)
    }
  }
}

function customOf (value: unknown): Fingerprint {
  if (typeof value !== 'string' && !Buffer.isBuffer(value)) {
    throw new TypeError(`fastify-idempotency: the fingerprint function must return a string or a Buffer; it returned ${typeof value}`)
  }
  return customFingerprint(value)
}

/** Answers from the record (draft §2.6): the original status, replayable headers and body bytes. */
function replay (engine: Engine, request: FastifyRequest, reply: FastifyReply, state: RequestState, response: StoredResponse): FastifyReply | Promise<FastifyReply> {
  if (isReference(response)) return replayReference(engine, request, reply, state, response)
  if (response.body === null) {
    observe(engine.metrics, state, 'not_retained', 'info', 'idempotency: completed key whose response was not retained')
    return answer(engine, state, reply, { kind: 'response-not-retained', extensions: { originalStatus: response.statusCode } })
  }
  state.lifecycle.replayed()
  if (state.context !== null) state.context.replayed = true
  observe(engine.metrics, state, 'replayed', 'debug', 'idempotency: replayed the recorded response')
  reply.code(response.statusCode)
  const headers = response.headers
  for (const name in headers) reply.header(name, replyValue(headers[name] as string | string[]))
  // Not in the draft; the de facto marker (Stripe, Increase; ietf-wg-httpapi/idempotency#46).
  reply.header('idempotent-replayed', 'true')
  // An original without a body had no Content-Type either; sending nothing keeps it that way.
  return response.body.length === 0 && headers['content-type'] === undefined ? reply.send() : reply.send(response.body)
}

/** A record of a response by reference: the route rebuilds the body from the resource's current state. */
async function replayReference (engine: Engine, request: FastifyRequest, reply: FastifyReply, state: RequestState, response: StoredResponse): Promise<FastifyReply> {
  const rebuild = state.settings.rebuild
  if (rebuild === null) {
    // Recorded by a route that had `rebuild`, replayed by one that no longer has it: the body was
    // never retained, so the honest answer is 410, not a re-execution.
    observe(engine.metrics, state, 'not_retained', 'error', 'idempotency: the record holds a reference but the route has no rebuild option')
    return answer(engine, state, reply, { kind: 'response-not-retained', extensions: { originalStatus: response.statusCode } })
  }
  state.lifecycle.replayed()
  if (state.context !== null) state.context.replayed = true
  observe(engine.metrics, state, 'replayed', 'debug', 'idempotency: rebuilt the response from its recorded reference')
  reply.header('idempotent-replayed', 'true')
  return await sendRebuilt(rebuild, request, reply, response)
}

function storeFailed (engine: Engine, request: FastifyRequest, reply: FastifyReply, state: RequestState, err: unknown): FastifyReply | undefined {
  // A record that cannot be opened (encryption: unknown key id, tampering) is not an outage: the
  // store answered, and the record says the operation ran, so bypassing would run it a second time.
  if (state.settings.onStoreError === 'bypass' && !(err instanceof SealedResponseError)) {
    state.lifecycle.unprotected()
    request.idempotency = null
    observe(engine.metrics, state, 'bypassed', 'error', 'idempotency: store failed; running the handler WITHOUT idempotency protection (onStoreError: bypass)', err)
    return undefined
  }
  observe(engine.metrics, state, 'store_error', 'error', 'idempotency: store failed; answering 503', err)
  return answer(engine, state, reply, { kind: 'store-unavailable', retryAfter: state.settings.retryAfter })
}
