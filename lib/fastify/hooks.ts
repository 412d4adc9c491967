import type {
  FastifyError, FastifyInstance, FastifyReply, FastifyRequest, HookHandlerDoneFunction, RequestPayload, RouteHandlerMethod
} from 'fastify'
import { claimRequest } from './claim.js'
import { FastifyRequestState, kState, stateOf, type StatefulRequest } from './request-state.js'
import { answer, type HttpEngine } from '../http/engine.js'
import { observedRequest } from '../http/observed-request.js'
import { hashingStream, startRawHash } from '../core/fingerprint.js'
import { keyFromFunction, parseKey, type KeyFunction, type ParsedKey } from '../http/key.js'
import { isThenable } from '../core/thenable.js'
import { observe } from '../core/observe.js'
import type { RouteSettings } from '../http/options.js'
import { releaseUnsent, rollBackForDepartedClient, settleOwner } from './settle.js'

export interface RouteHooks {
  readonly onRequest: (request: FastifyRequest, reply: FastifyReply, done: HookHandlerDoneFunction) => void
  readonly preParsing: ((request: FastifyRequest, reply: FastifyReply, payload: RequestPayload, done: (err: Error | null, payload?: RequestPayload) => void) => void) | null
  readonly preHandler: (request: FastifyRequest, reply: FastifyReply, done: HookHandlerDoneFunction) => Promise<FastifyReply | undefined> | undefined
  readonly onError: (request: FastifyRequest, reply: FastifyReply, error: FastifyError, done: () => void) => void
  readonly onResponse: (request: FastifyRequest, reply: FastifyReply, done: HookHandlerDoneFunction) => void
  /** Atomic mode only: lease mode has nothing to do when a socket times out (lib/core/lifecycle.ts). */
  readonly onTimeout: ((request: FastifyRequest, reply: FastifyReply, done: HookHandlerDoneFunction) => void) | null
}

/**
 * The hooks of one protected route, built once when the route is added. `methods` limits them to
 * some of the route's methods (a route declared for several), or null for all of them.
 */
export function routeHooks (engine: HttpEngine, settings: RouteSettings, methods: ReadonlySet<string> | null): RouteHooks {
  // onRequest: the key needs no body, so a missing or malformed one is refused before any parsing.
  function idempotencyParseKey (request: FastifyRequest, reply: FastifyReply, done: HookHandlerDoneFunction): void {
    if (methods !== null && !methods.has(request.method)) return done()
    // A key from the `key` option is read in the claim, once the route's verification has run:
    // the state is there for the body's hash, with no key yet.
    if (settings.key !== null) {
      (request as StatefulRequest)[kState] = new FastifyRequestState('', settings, request)
      return done()
    }
    const parsed = parseKey(request.headers['idempotency-key'], request.raw.rawHeaders, settings.keyFormat, settings.maxKeyLength)
    if (parsed.ok) {
      (request as StatefulRequest)[kState] = new FastifyRequestState(parsed.key, settings, request)
      return done()
    }
    if (parsed.reason === 'missing' && !settings.required) return done()
    // Answered from the hook: not calling done() ends the lifecycle here (the handler never runs).
    refuseKey(request, reply, parsed)
  }

  function refuseKey (request: FastifyRequest, reply: FastifyReply, parsed: Exclude<ParsedKey, { ok: true }>): FastifyReply {
    observe(engine.metrics, observedRequest(request, '', '', performance.now()), parsed.reason === 'missing' ? 'key_missing' : 'key_invalid', 'info', 'idempotency: request refused')
    if (parsed.reason === 'invalid') return answer(engine, null, reply, { kind: 'key-invalid', detail: parsed.detail })
    // A missing header gets the profile's own key-missing answer (the body the OpenAPI example shows);
    // a route with a `key` option says where it looked instead, since it reads no header.
    return answer(engine, null, reply, settings.key === null ? { kind: 'key-missing' } : { kind: 'key-missing', detail: parsed.detail })
  }

  /**
   * The `key` option's key, once the request is verified and its body parsed: true when the claim
   * goes on; false when the request runs unprotected or was answered (and `done` was dealt with).
   */
  function keyFromRoute (keyOf: KeyFunction, request: FastifyRequest, reply: FastifyReply, state: FastifyRequestState, done: HookHandlerDoneFunction): boolean {
    let parsed: ParsedKey
    try {
      parsed = keyFromFunction(keyOf, request, settings.maxKeyLength)
    } catch (err) {
      (request as StatefulRequest)[kState] = null
      done(err as Error)
      return false
    }
    if (parsed.ok) {
      state.key = parsed.key
      return true
    }
    (request as StatefulRequest)[kState] = null
    if (parsed.reason === 'missing' && !settings.required) done()
    else refuseKey(request, reply, parsed)
    return false
  }

  // preParsing (raw fingerprints only): hash the body bytes as they stream to the parser.
  function idempotencyHashBody (request: FastifyRequest, _reply: FastifyReply, payload: RequestPayload, done: (err: Error | null, payload?: RequestPayload) => void): void {
    const state = stateOf(request)
    if (state === null) return done(null, payload)
    state.rawHash = startRawHash(request.method, request.url)
    done(null, hashingStream(payload, state.rawHash))
  }

  // Callback style when the claim is synchronous (lib/fastify/claim.ts): the handler runs (done()), or the
  // request was answered (no done(): the chain stops there). Otherwise the claim's promise, which
  // Fastify awaits: it resolves with undefined (run) or with the reply (answered, once sent).
  function idempotencyClaim (request: FastifyRequest, reply: FastifyReply, done: HookHandlerDoneFunction): Promise<FastifyReply | undefined> | undefined {
    const state = stateOf(request)
    // Preempted: an earlier hook's answer is on its way out, and the store is not asked for a key
    // nothing will use (the handler wrapper keeps the handler from running).
    if (state === null || state.lifecycle.phase === 'preempted') {
      done()
      return undefined
    }
    if (settings.key !== null && !keyFromRoute(settings.key, request, reply, state, done)) return undefined
    const claimed = claimRequest(engine, request, reply, state)
    if (claimed === undefined) done()
    // The reply is a thenable too: answered synchronously, it is returned as itself.
    else if (claimed !== reply && isThenable(claimed)) return claimed
    return undefined
  }

  // An error answering the request is a failure whatever status the error handler turns it into
  // (lib/core/lifecycle.ts decides the key's fate); one that answers while the claim is in flight keeps
  // the handler from running.
  function idempotencyFlagError (request: FastifyRequest, _reply: FastifyReply, _error: FastifyError, done: () => void): void {
    stateOf(request)?.lifecycle.errored()
    done()
  }

  // Callback style: it runs on every protected request and almost never has anything to do.
  function idempotencyCleanup (request: FastifyRequest, _reply: FastifyReply, done: HookHandlerDoneFunction): void {
    const state = stateOf(request)
    if (state === null || state.lifecycle.phase !== 'owner') return done()
    releaseUnsent(engine, state).then(() => done(), done)
  }

  // The socket timed out (connectionTimeout): as for a client that left, roll back.
  function idempotencyRollBack (request: FastifyRequest, _reply: FastifyReply, done: HookHandlerDoneFunction): void {
    const state = stateOf(request)
    if (state !== null) rollBackForDepartedClient(engine, state)
    done()
  }

  return {
    onRequest: idempotencyParseKey,
    preParsing: settings.fingerprint.mode === 'raw' ? idempotencyHashBody : null,
    preHandler: idempotencyClaim,
    onError: idempotencyFlagError,
    onResponse: idempotencyCleanup,
    onTimeout: settings.transaction ? idempotencyRollBack : null
  }
}

/**
 * The route's handler, wrapped so the lifecycle knows while it runs: an answer that interrupts it
 * (handlerTimeout) is settled only once it returned, since until then it may still produce its
 * effect. And it runs only while the request owns its key (or runs unprotected after a bypass):
 * Fastify calls the handler once the preHandler hooks are done unless the response has ENDED, so an
 * answer still on its way out (a handlerTimeout's 503 being sent while the claim landed, or while a
 * later preHandler ran) would otherwise let it run beside a key that is being given back or released.
 */
export function trackHandler (handler: RouteHandlerMethod): RouteHandlerMethod {
  return function idempotencyHandler (this: FastifyInstance, request, reply) {
    const state = stateOf(request)
    if (state === null) return handler.call(this, request, reply)
    const lifecycle = state.lifecycle
    if (!lifecycle.runsHandler) return undefined
    if (lifecycle.phase !== 'owner') return handler.call(this, request, reply)
    lifecycle.handlerStarted()
    let result: unknown
    try {
      result = handler.call(this, request, reply)
    } catch (err) {
      lifecycle.handlerReturned('threw')
      throw err
    }
    // A reply is a thenable too (it resolves once sent): a sync handler that returns it has returned.
    if (result !== reply && isThenable(result)) {
      result.then(() => { lifecycle.handlerReturned('returned') }, () => { lifecycle.handlerReturned('threw') })
    } else {
      lifecycle.handlerReturned('returned')
    }
    return result
  } as RouteHandlerMethod
}

/**
 * onSend, added once for the whole context so it runs before route-level onSend hooks such as
 * @fastify/compress's: what is recorded is the body the handler produced. Only the owner of a key
 * records; replays and the plugin's own problem answers pass through untouched (they must never
 * become a key's outcome). The owner's path returns a promise when it has to wait for the store,
 * so that an answer Fastify or Node then refuses (a header writeHead rejects) is caught by Fastify's
 * hook runner and becomes a 500, as it would without the plugin, instead of an unhandled rejection;
 * recorded synchronously, it calls done() within the runner's own try.
 */
export function createRecordHook (engine: HttpEngine) {
  return function idempotencyRecord (request: FastifyRequest, reply: FastifyReply, payload: unknown, done: (err: Error | null, payload?: unknown) => void): Promise<unknown> | undefined {
    const state = stateOf(request)
    if (state === null) {
      done(null, payload)
      return undefined
    }
    switch (state.lifecycle.respond()) {
      case 'settle': {
        const settled = settleOwner(engine, reply, state, payload)
        if (settled instanceof Promise) return settled
        done(null, settled)
        return undefined
      }
      case 'duplicate':
        state.log.debug('idempotency: reply.send() called again while the first answer is being recorded; the second is dropped (return reply from an async handler that calls reply.send())')
        // A promise that never settles (a fresh one: reactions on a shared one would pile up forever):
        // the onSend chain of the dropped send stops here.
        return new Promise<never>(() => {})
      case 'pass':
        done(null, payload)
        return undefined
    }
  }
}
