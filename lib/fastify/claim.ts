import type { FastifyReply, FastifyRequest } from 'fastify'
import { claimKey, type Decision } from '../core/claim.js'
import type { IdempotencyContext } from '../core/context.js'
import { canonicalFingerprint, customFingerprint, finishRawHash, startRawHash } from '../core/fingerprint.js'
import { CanonicalLimitError } from '../core/fingerprint-canonical.js'
import { observe } from '../core/observe.js'
import type { Fingerprint, StoredResponse } from '../core/store.js'
import { isThenable } from '../core/thenable.js'
import { answer, type HttpEngine } from '../http/engine.js'
import { replyValue } from '../http/headers.js'
import { appliedWait, preferredWait } from '../http/prefer.js'
import { isReference, sendRebuilt } from '../http/reference.js'
import { scopeOf } from '../http/scope.js'
import type { FastifyRequestState } from './request-state.js'
import { rollBackForDepartedClient } from './settle.js'

/** What the claim decided: undefined, the handler runs; a reply, the request was answered. */
type Claimed = FastifyReply | undefined

/**
 * preHandler: the body is parsed and validated and the caller authenticated, so this is the first
 * point where the request is known to be one the handler would run. Resolves the scope, computes
 * the fingerprint, lets the core claim the key (lib/core/claim.ts), and answers what it decided:
 * the handler runs (owner), a replay, 409, 422, 503. Synchronous from end to end when everything it
 * needs is (a sync scope and fingerprint, a store with synchronous operations, no pre-filter, no
 * wait, lease mode): the embedded default pays no promise for it.
 */
export function claimRequest (engine: HttpEngine, request: FastifyRequest, reply: FastifyReply, state: FastifyRequestState): Claimed | Promise<Claimed> {
  const scoped = scopeOf(state.settings.scope, request)
  return isThenable(scoped)
    ? Promise.resolve(scoped).then((scope) => claimScoped(engine, request, reply, state, scope))
    : claimScoped(engine, request, reply, state, scoped)
}

function claimScoped (engine: HttpEngine, request: FastifyRequest, reply: FastifyReply, state: FastifyRequestState, scope: string): Claimed | Promise<Claimed> {
  state.scope = scope
  if (state.settings.wait > 0) state.preferredWait = preferredWait(request.headers.prefer)
  let unkeyed: Fingerprint | Promise<Fingerprint>
  try {
    unkeyed = fingerprintOf(request, state)
  } catch (err) {
    if (err instanceof CanonicalLimitError) return refuseBody(engine, reply, state, err)
    throw err
  }
  return isThenable(unkeyed)
    ? Promise.resolve(unkeyed).then((fingerprint) => decided(engine, request, reply, state, claimKey(engine, state, fingerprint)))
    : decided(engine, request, reply, state, claimKey(engine, state, unkeyed))
}

function decided (engine: HttpEngine, request: FastifyRequest, reply: FastifyReply, state: FastifyRequestState, decision: Decision | Promise<Decision>): Claimed | Promise<Claimed> {
  return isThenable(decision)
    ? decision.then((settled) => answerDecision(engine, request, reply, state, settled))
    : answerDecision(engine, request, reply, state, decision)
}

/** The claim's decision as this request's answer (or undefined: the handler runs, or Fastify finishes another answer). */
function answerDecision (engine: HttpEngine, request: FastifyRequest, reply: FastifyReply, state: FastifyRequestState, decision: Decision): Claimed | Promise<Claimed> {
  // `sql` (atomic mode) is typed by the Postgres entry point's augmentation of IdempotencyContext.
  request.idempotency = decision.kind === 'bypass' ? null : state.context as IdempotencyContext | null
  switch (decision.kind) {
    case 'run':
      if (state.lifecycle.transactional) watchClient(engine, reply, state)
      return undefined
    case 'bypass':
      return undefined
    case 'preempted':
      // The answer that went out is Fastify's to finish; the handler wrapper keeps the handler from running.
      return undefined
    case 'replay':
      saidWait(reply, state)
      return replay(engine, request, reply, state, decision.response)
    case 'in-progress':
      saidWait(reply, state)
      return answer(engine, null, reply, { kind: 'request-in-progress', retryAfter: state.settings.retryAfter })
    case 'mismatch':
      saidWait(reply, state)
      return answer(engine, null, reply, { kind: 'key-reused' })
    case 'unavailable':
      return answer(engine, null, reply, { kind: 'store-unavailable', retryAfter: state.settings.retryAfter })
  }
}

/** A duplicate's answer tells a client that asked for a wait (`Prefer: wait`) the wait it got (RFC 7240 §3). */
function saidWait (reply: FastifyReply, state: FastifyRequestState): void {
  if (state.preferredWait !== null) reply.header('preference-applied', appliedWait(state.preferredWait, state.settings.wait))
}

/**
 * Atomic mode: a client that leaves while the handler runs. Node emits the request's 'close' as
 * soon as its body is read, so onRequestAbort misses it; the response closing before its end does
 * not. A client that left while the claim waited (for a pool connection, or on another attempt's
 * lock) closed its response before this listener existed: roll back now, as if it had left while
 * the handler ran; the key is free for its retry.
 */
function watchClient (engine: HttpEngine, reply: FastifyReply, state: FastifyRequestState): void {
  const res = reply.raw
  if (res.closed && !res.writableFinished) rollBackForDepartedClient(engine, state)
  else res.once('close', () => { if (!res.writableFinished) rollBackForDepartedClient(engine, state) })
}

/** The parsed body is beyond the route's maxBodyDepth or maxBodyNodes: refused before anything is claimed. */
function refuseBody (engine: HttpEngine, reply: FastifyReply, state: FastifyRequestState, err: CanonicalLimitError): FastifyReply {
  observe(engine.metrics, state, 'body_refused', 'info', `idempotency: request refused: ${err.message}`)
  return err.limit === 'depth'
    ? answer(engine, state, reply, { kind: 'body-too-deep', extensions: { maxBodyDepth: err.max } })
    : answer(engine, state, reply, { kind: 'body-too-large', extensions: { maxBodyNodes: err.max } })
}

/** The unkeyed fingerprint; synchronous but for a custom function that returns a promise. */
function fingerprintOf (request: FastifyRequest, state: FastifyRequestState): Fingerprint | Promise<Fingerprint> {
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
function replay (engine: HttpEngine, request: FastifyRequest, reply: FastifyReply, state: FastifyRequestState, response: StoredResponse): FastifyReply | Promise<FastifyReply> {
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
async function replayReference (engine: HttpEngine, request: FastifyRequest, reply: FastifyReply, state: FastifyRequestState, response: StoredResponse): Promise<FastifyReply> {
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
