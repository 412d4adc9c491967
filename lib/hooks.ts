import type {
  FastifyError, FastifyReply, FastifyRequest, HookHandlerDoneFunction, RequestPayload
} from 'fastify'
import { claimKey } from './claim.js'
import { kState, RequestState, stateOf, type StatefulRequest } from './context.js'
import { answer, type Engine } from './engine.js'
import { hashingStream, startRawHash } from './fingerprint.js'
import { parseKey } from './key.js'
import { observe } from './observe.js'
import type { RouteSettings } from './options.js'
import { abandon, releaseUnsent, settleOwner } from './settle.js'

export interface RouteHooks {
  readonly onRequest: (request: FastifyRequest, reply: FastifyReply, done: HookHandlerDoneFunction) => void
  readonly preParsing: ((request: FastifyRequest, reply: FastifyReply, payload: RequestPayload, done: (err: Error | null, payload?: RequestPayload) => void) => void) | null
  readonly preHandler: (request: FastifyRequest, reply: FastifyReply) => Promise<FastifyReply | undefined>
  readonly onError: (request: FastifyRequest, reply: FastifyReply, error: FastifyError, done: () => void) => void
  readonly onResponse: (request: FastifyRequest, reply: FastifyReply, done: HookHandlerDoneFunction) => void
  readonly onTimeout: (request: FastifyRequest, reply: FastifyReply, done: HookHandlerDoneFunction) => void
}

/**
 * The hooks of one protected route, built once when the route is added. `methods` limits them to
 * some of the route's methods (a route declared for several), or null for all of them.
 */
export function routeHooks (engine: Engine, settings: RouteSettings, methods: ReadonlySet<string> | null): RouteHooks {
  // onRequest: the key needs no body, so a missing or malformed one is refused before any parsing.
  function idempotencyParseKey (request: FastifyRequest, reply: FastifyReply, done: HookHandlerDoneFunction): void {
    if (methods !== null && !methods.has(request.method)) return done()
    const parsed = parseKey(request.headers['idempotency-key'], request.raw.rawHeaders, settings.keyFormat, settings.maxKeyLength)
    if (parsed.ok) {
      (request as StatefulRequest)[kState] = new RequestState(parsed.key, settings, request)
      return done()
    }
    if (parsed.reason === 'missing' && !settings.required) return done()
    const refused = { key: '', scope: '', log: request.log, request, startedAt: performance.now() }
    observe(engine.metrics, refused, parsed.reason === 'missing' ? 'key_missing' : 'key_invalid', 'info', 'idempotency: request refused')
    // Answered from the hook: not calling done() ends the lifecycle here (the handler never runs).
    answer(engine, null, reply, parsed.reason === 'missing'
      ? { kind: 'key-missing' }
      : { kind: 'key-invalid', detail: parsed.detail })
  }

  // preParsing (raw fingerprints only): hash the body bytes as they stream to the parser.
  function idempotencyHashBody (request: FastifyRequest, _reply: FastifyReply, payload: RequestPayload, done: (err: Error | null, payload?: RequestPayload) => void): void {
    const state = stateOf(request)
    if (state === null) return done(null, payload)
    state.rawHash = startRawHash(request.method, request.url)
    done(null, hashingStream(payload, state.rawHash))
  }

  async function idempotencyClaim (request: FastifyRequest, reply: FastifyReply): Promise<FastifyReply | undefined> {
    const state = stateOf(request)
    if (state === null) return undefined
    return claimKey(engine, request, reply, state)
  }

  // Errors thrown by the handler (or a later hook) release the key: a thrown error is a failure
  // whatever status the error handler turns it into.
  function idempotencyFlagError (request: FastifyRequest, _reply: FastifyReply, _error: FastifyError, done: () => void): void {
    const state = stateOf(request)
    if (state !== null && state.phase === 'owner') state.errored = true
    done()
  }

  // Callback style: it runs on every protected request and almost never has anything to do.
  function idempotencyCleanup (request: FastifyRequest, _reply: FastifyReply, done: HookHandlerDoneFunction): void {
    const state = stateOf(request)
    if (state === null || state.phase !== 'owner') return done()
    releaseUnsent(engine, state).then(() => done(), done)
  }

  // The socket timed out (connectionTimeout): as for a client that left, stop renewing the lease.
  function idempotencyAbandon (request: FastifyRequest, _reply: FastifyReply, done: HookHandlerDoneFunction): void {
    const state = stateOf(request)
    if (state !== null && state.phase === 'owner') abandon(engine, state)
    done()
  }

  return {
    onRequest: idempotencyParseKey,
    preParsing: settings.fingerprint.mode === 'raw' ? idempotencyHashBody : null,
    preHandler: idempotencyClaim,
    onError: idempotencyFlagError,
    onResponse: idempotencyCleanup,
    onTimeout: idempotencyAbandon
  }
}

/**
 * onSend, added once for the whole context so it runs before route-level onSend hooks such as
 * @fastify/compress's: what is recorded is the body the handler produced. Only the owner of a key
 * records; replays and the plugin's own problem answers pass through untouched (they must never
 * become a key's outcome).
 */
export function createRecordHook (engine: Engine) {
  return function idempotencyRecord (request: FastifyRequest, reply: FastifyReply, payload: unknown, done: (err: Error | null, payload?: unknown) => void): void {
    const state = stateOf(request)
    if (state === null || state.phase !== 'owner') return done(null, payload)
    settleOwner(engine, reply, state, payload).then((sent) => done(null, sent), done)
  }
}
