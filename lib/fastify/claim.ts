import type { FastifyReply, FastifyRequest } from 'fastify'
import type { IdempotencyContext, RequestState } from '../core/context.js'
import { answer, type Engine } from '../core/engine.js'
import { StoreTimeoutError } from '../core/errors.js'
import { observe } from '../core/observe.js'
import { canonicalFingerprint, customFingerprint, finishRawHash, startRawHash } from '../core/fingerprint.js'
import { CanonicalLimitError } from '../core/fingerprint-canonical.js'
import { keyedFingerprint, matchFingerprint, UNVERIFIABLE } from '../core/fingerprint-keys.js'
import { SealedResponseError } from '../core/encryption.js'
import { replyValue } from '../http/headers.js'
import { RequestContext } from '../core/recovery.js'
import { scopeOf } from '../http/scope.js'
import { isThenable } from '../core/thenable.js'
import { isReference, sendRebuilt } from '../http/reference.js'
import { clearInFlight, consultPrefilter, markInFlight, rememberCompleted } from '../core/prefiltering.js'
import { giveBack } from '../core/outcome.js'
import { rollBackForDepartedClient } from './settle.js'
import type { Answer, ClaimAcquired, ClaimCompleted, ClaimInProgress, ClaimRequest, ClaimResult, Fingerprint, StoredResponse } from '../core/store.js'
import { bounded, boundedPromise } from '../core/timeout.js'
import { localId } from '../core/waiters.js'

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
 * The fingerprint stored for this request: with `encryption`, keyed (lib/core/fingerprint-keys.ts), so
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
  if (engine.prefilter !== null || settings.wait > 0 || settings.transaction) return claimLoop(engine, request, reply, state, claim)
  // One store call. A store that answers directly (the memory store) is decided on at once, with no
  // promise: the embedded default's whole claim stays synchronous.
  const askedAt = performance.now()
  let answer: Answer<ClaimResult>
  try {
    answer = engine.store.claim(claim)
  } catch (err) {
    return storeFailed(engine, request, reply, state, err)
  }
  if (!isThenable(answer)) return claimed(engine, request, reply, state, fingerprint, answer, null)
  return boundedPromise('claim', settings.storeTimeout, answer, giveBackLate(engine, state)).then(
    (result) => claimed(engine, request, reply, state, fingerprint, result, askedAt),
    (err: unknown) => storeFailed(engine, request, reply, state, err)
  )
}

/** The store's answer to one claim, without a pre-filter or a wait: run, replay, 422 or 409. */
function claimed (engine: Engine, request: FastifyRequest, reply: FastifyReply, state: RequestState, fingerprint: Fingerprint, result: ClaimResult, askedAt: number | null): Claimed | Promise<Claimed> {
  if (result.outcome === 'acquired') return acquired(engine, request, reply, state, result, askedAt)
  const adopted = adoptRotated(engine, request, state, result, fingerprint)
  if (adopted !== null) return claimFor(engine, request, reply, state, adopted)
  return answerHeld(engine, request, reply, state, result, fingerprint) ?? refuseInProgress(engine, reply, state)
}

/**
 * The store handed the key over: the lifecycle says whether this request can still use it. Not when
 * another answer went out while the claim was in flight (a handlerTimeout: the handler never runs),
 * nor when the answer came back too late in its lease (lib/core/lifecycle.ts, `landed`): the key is given
 * back at once, so no retry waits a lease for it (lib/core/outcome.ts, `giveBack`).
 */
function acquired (engine: Engine, request: FastifyRequest, reply: FastifyReply, state: RequestState, result: ClaimAcquired, askedAt: number | null): Claimed {
  switch (state.lifecycle.landed(engine, result, askedAt)) {
    case 'own':
      becomeOwner(engine, reply, state, result)
      return undefined
    case 'preempted':
      giveBack(engine, state, result, 'landed after another answer went out')
      // The answer that went out is Fastify's to finish; the handler wrapper keeps the handler from running.
      return undefined
    case 'stale':
      giveBack(engine, state, result, 'came back too late in its lease')
      return storeFailed(engine, request, reply, state, new StoreTimeoutError('claim', state.settings.lease))
  }
}

/**
 * The claim with a pre-filter, a `wait`, or in atomic mode. The pre-filter answers only from a
 * completed copy, which is the store's committed record; an in-flight marker is not the store's word
 * (it may be older than the store's answer, or this very request's: lib/core/prefilter.ts), so it never
 * answers: while the route may wait, it is a reason to wait without asking the store, and the store
 * is asked before any answer is given.
 */
async function claimLoop (engine: Engine, request: FastifyRequest, reply: FastifyReply, state: RequestState, claim: ClaimRequest): Promise<Claimed> {
  const settings = state.settings
  let fingerprint = claim.fingerprint
  const deadline = settings.wait > 0 ? Date.now() + settings.wait : 0
  let poll = FIRST_POLL_MS
  for (let round = 0; ; round++) {
    let held: ClaimInProgress | ClaimCompleted
    // Markers only matter to duplicates that wait: a route that does not wait sets none.
    const hit = engine.prefilter === null ? null : await consultPrefilter(engine, state, fingerprint, round === 0 && settings.wait > 0)
    if (hit?.state === 'completed') {
      held = { outcome: 'completed', fingerprint: hit.fingerprint, response: hit.response }
    } else if (hit?.state === 'in_progress' && deadline - Date.now() > 0 && isFingerprint(matchOf(engine, state, hit.fingerprint, fingerprint))) {
      await engine.waiters.wait(localId(state.scope, state.key), Math.min(poll, deadline - Date.now()))
      poll = Math.min(poll * 2, MAX_POLL_MS)
      continue
    } else {
      const asked = Date.now()
      const askedAt = performance.now()
      let result: ClaimResult
      try {
        if (settings.transaction) {
          const waitMs = Math.max(0, deadline - Date.now())
          result = await bounded('claim', settings.storeTimeout + waitMs, () => claimInTransaction(engine, claim, waitMs), giveBackLate(engine, state))
        } else {
          result = await bounded('claim', settings.storeTimeout, () => engine.store.claim(claim), giveBackLate(engine, state))
        }
      } catch (err) {
        if (state.markedInFlight) clearInFlight(engine, state)
        return storeFailed(engine, request, reply, state, err)
      }
      if (result.outcome === 'acquired') return acquired(engine, request, reply, state, result, settings.transaction ? null : askedAt)
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

function refuseInProgress (engine: Engine, reply: FastifyReply, state: RequestState): FastifyReply {
  observe(engine.metrics, state, 'conflict', 'info', 'idempotency: original request still in progress')
  return answer(engine, state, reply, { kind: 'request-in-progress', retryAfter: state.settings.retryAfter })
}

/** The store handed the key to this request: it executes, holding the key until it settles. */
function becomeOwner (engine: Engine, reply: FastifyReply, state: RequestState, result: ClaimAcquired): void {
  if (result.takeover) observe(engine.metrics, state, 'taken_over', 'warn', 'idempotency: took over an in-progress key whose owner stopped renewing its lease')
  else observe(engine.metrics, state, 'executed', 'debug', 'idempotency: key claimed')
  const context = state.context as RequestContext
  if (state.settings.wait > 0) markInFlight(engine, state, context.fingerprint)
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

/** A claim that lands after its storeTimeout was answered 503 (or bypassed): given back at once. */
function giveBackLate (engine: Engine, state: RequestState) {
  return (result: ClaimResult): void => {
    if (result.outcome === 'acquired') giveBack(engine, state, result, 'landed after storeTimeout')
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
