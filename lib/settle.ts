import { validateHeaderName, validateHeaderValue } from 'node:http'
import type { FastifyReply } from 'fastify'
import { captureStream, classifyPayload, type CapturedPayload } from './capture.js'
import type { RequestState } from './context.js'
import type { Engine } from './engine.js'
import { RolledBackError } from './errors.js'
import { observe } from './observe.js'
import { pickReplayHeaders } from './headers.js'
import { clearInFlight, rememberCompleted } from './prefiltering.js'
import { applyProblem, type ProblemKind } from './problems.js'
import { deliverEnqueued } from './recovery.js'
import { referenceRecord } from './reference.js'
import type { Lease, StoredResponse } from './store.js'
import { withTimeout } from './timeout.js'

/** Recording the outcome is retried briefly: losing it would let a retry execute a second time. */
const COMPLETE_RETRY_DELAYS_MS = [50, 250]

/**
 * onSend of the request that owns the key (the lifecycle moved it to `settling`): records the
 * response before it leaves (for a stream, before its last byte leaves), or releases the key when
 * the outcome is a failure. Returns the payload to send on: at once when the store recorded it
 * synchronously (lib/store.ts, SyncOperations), else a promise of it. Whatever goes wrong in here
 * (a throwing `record` rule, a bug), the key is released or held, never stranded in progress.
 */
export function settleOwner (engine: Engine, reply: FastifyReply, state: RequestState, payload: unknown): unknown {
  let settled: unknown
  try {
    settled = settle(engine, reply, state, payload)
  } catch (err) {
    return settleFailed(engine, state, payload, err)
  }
  if (settled instanceof Promise) {
    return settled.then((sent: unknown) => {
      state.lifecycle.responded()
      return sent
    }, (err: unknown) => settleFailed(engine, state, payload, err))
  }
  state.lifecycle.responded()
  return settled
}

async function settleFailed (engine: Engine, state: RequestState, payload: unknown, err: unknown): Promise<unknown> {
  try {
    observe(engine.metrics, state, 'settle_failed', 'error', 'idempotency: unexpected error while settling the response; it is not recorded', err)
    await giveUp(engine, state, 'an unexpected error while settling the response')
    return payload
  } finally {
    state.lifecycle.responded()
  }
}

/** The payload to send on, or a promise of it; what it cannot do at once it does through promises. */
function settle (engine: Engine, reply: FastifyReply, state: RequestState, payload: unknown): unknown {
  if (state.errored) return giveUp(engine, state, 'the handler failed').then(() => payload)

  const captured = classifyPayload(payload, reply)
  const sent = captured.kind === 'stream' ? captured.source : payload
  const statusCode = reply.statusCode
  if (!state.settings.record(statusCode)) return giveUp(engine, state, `status ${statusCode} is not recorded`).then(() => sent)
  if (captured.kind === 'unsupported') return giveUp(engine, state, 'the payload type cannot be recorded').then(() => payload)
  // Node refuses such a response in writeHead, after onSend, and Fastify then answers 500: the
  // client never receives it, so it must not become the key's outcome.
  let replyHeaders = reply.getHeaders()
  const unsendable = unsendableHeader(replyHeaders)
  if (unsendable !== null) {
    observe(engine.metrics, state, 'not_recorded', 'error', `idempotency: the response has a header Node cannot send (${unsendable}); it is not recorded`)
    return giveUp(engine, state, 'the response cannot be sent').then(() => sent)
  }

  // A Buffer is replayed with Fastify's default type for bytes; give the original the same one.
  if (captured.kind === 'stream' && replyHeaders['content-type'] === undefined) {
    reply.header('content-type', 'application/octet-stream')
    replyHeaders = reply.getHeaders()
  }
  const headers = pickReplayHeaders(replyHeaders, state.settings.replayHeaders)
  const limit = state.settings.maxResponseBytes
  const reference = referenceOf(engine, state, statusCode, headers)
  if (state.lifecycle.transactional) return commitThenSend(engine, reply, state, captured, headers, reference)
  // A reference: the body is sent as the handler produced it (a stream streams); only the reference is kept.
  if (reference !== null) return recordThen(engine, state, reference, sent)
  if (captured.kind === 'bytes') return recordThen(engine, state, { statusCode, headers, body: captured.body.length > limit ? null : captured.body }, payload)
  return captureStream(captured.source, limit, {
    onEnd: (body) => record(engine, state, { statusCode, headers, body }),
    onError: () => giveUp(engine, state, 'the response stream failed')
  })
}

/** Records `response`, then hands `sent` back: at once through the store's synchronous complete, else once record() is done. */
function recordThen (engine: Engine, state: RequestState, response: StoredResponse, sent: unknown): unknown {
  const sync = engine.sync
  if (sync !== null) {
    const since = Date.now()
    let completed: boolean | null = null
    // A throw is treated as a failed attempt: record() below tries again, with its delays.
    try { completed = sync.complete(state.lifecycle.lease as Lease, response, state.settings.ttl) } catch {}
    if (completed !== null) {
      recorded(engine, state, completed, response, since)
      state.lifecycle.settled()
      return sent
    }
  }
  return record(engine, state, response).then(() => sent)
}

/** The first header of `headers` that Node's writeHead would refuse, described, or null. */
function unsendableHeader (headers: Readonly<Record<string, string | number | string[] | undefined>>): string | null {
  for (const name in headers) {
    const value = headers[name]
    try {
      validateHeaderName(name)
      if (Array.isArray(value)) for (const item of value) validateHeaderValue(name, item)
      else if (value !== undefined) validateHeaderValue(name, String(value))
    } catch (err) {
      return (err as Error).message
    }
  }
  return null
}

/**
 * onResponse of a request that still owns its key: the response left without passing through
 * onSend (reply.hijack(), a raw write), so there is nothing to record. Released, so the key is
 * not stuck; such routes get concurrency protection only.
 */
export async function releaseUnsent (engine: Engine, state: RequestState): Promise<void> {
  if (!state.lifecycle.unsent()) return
  observe(engine.metrics, state, 'not_recorded', 'warn', 'idempotency: the response bypassed onSend (reply.hijack() or a raw write), so it cannot be recorded')
  await giveUp(engine, state, 'the response was not sent through Fastify')
}

/**
 * Atomic mode, the client went away before the answer was committed: roll back now, which removes
 * the claim and the handler's writes together (its later queries fail), so a retry runs the
 * operation afresh. Lease mode: nothing to do (see lib/lifecycle.ts).
 */
export function rollBackForDepartedClient (engine: Engine, state: RequestState): void {
  if (state.lifecycle.clientLeft()) {
    release(engine, state, 'the client went away before the transaction committed').catch(/* c8 ignore next: release catches */ () => {})
  }
}

/**
 * Atomic mode: the response is recorded and the transaction committed before a byte is sent, so a
 * client never sees a success that was rolled back. A stream is therefore read whole first (status
 * and headers cannot be taken back once a stream has started). If the commit failed, the client gets
 * a 500 problem instead of the handler's body: nothing of the operation happened. If the store cannot
 * tell (the connection dropped or timed out after COMMIT was sent), it gets a 503 that says so: the
 * retry replays the committed response or runs the operation afresh, whichever is true.
 */
async function commitThenSend (
  engine: Engine,
  reply: FastifyReply,
  state: RequestState,
  captured: Exclude<CapturedPayload, { kind: 'unsupported' }>,
  headers: Record<string, string | string[]>,
  reference: StoredResponse | null
): Promise<unknown> {
  const lease = state.lifecycle.lease as Lease
  let body: Buffer
  if (captured.kind === 'bytes') {
    body = captured.body
  } else {
    try {
      const chunks = await captured.source.toArray() as Array<Buffer | string>
      body = Buffer.concat(chunks.map((chunk) => typeof chunk === 'string' ? Buffer.from(chunk) : chunk))
    } catch (err) {
      observe(engine.metrics, state, 'not_recorded', 'error', 'idempotency: the response stream failed before its end; the transaction is rolled back', err)
      await release(engine, state, 'the response stream failed')
      return notCommitted(engine, reply, state, 'not-committed')
    }
  }
  const response: StoredResponse = reference ?? { statusCode: reply.statusCode, headers, body: body.length > state.settings.maxResponseBytes ? null : body }
  try {
    const since = Date.now()
    const committed = await withTimeout('complete', state.settings.storeTimeout, () => engine.store.complete(lease, response, state.settings.ttl))
    if (!committed) throw new RolledBackError('the transaction had already ended (rolled back) before the commit')
    observe(engine.metrics, state, 'recorded', 'debug', 'idempotency: response recorded and transaction committed')
    deliverEnqueued(engine, state)
    if (state.context !== null) rememberCompleted(engine, state, state.context.fingerprint, response, state.settings.ttl, since)
  } catch (err) {
    clearInFlight(engine, state)
    state.lifecycle.settled()
    if (err instanceof RolledBackError) {
      observe(engine.metrics, state, 'store_error', 'error', 'idempotency: the transaction was rolled back instead of committed; answering 500', err)
      return notCommitted(engine, reply, state, 'not-committed')
    }
    observe(engine.metrics, state, 'store_error', 'error', 'idempotency: the commit was sent but its outcome is unknown; answering 503', err)
    return notCommitted(engine, reply, state, 'outcome-unknown')
  }
  state.lifecycle.settled()
  return captured.kind === 'bytes' ? undefined : body
}

/**
 * The record of a response by reference, when the route rebuilds replays (`rebuild`) and the handler
 * set `request.idempotency.reference`; null to record the body as usual.
 */
function referenceOf (engine: Engine, state: RequestState, statusCode: number, headers: Record<string, string | string[]>): StoredResponse | null {
  const reference = state.context?.reference
  if (state.settings.rebuild === null || reference === undefined) return null
  const response = referenceRecord(statusCode, headers, reference)
  if (response === null) {
    observe(engine.metrics, state, 'not_recorded', 'error', 'idempotency: request.idempotency.reference is not JSON-serializable; recording the response body instead')
  }
  return response
}

function notCommitted (engine: Engine, reply: FastifyReply, state: RequestState, kind: Extract<ProblemKind, 'not-committed' | 'outcome-unknown'>): string {
  for (const name of Object.keys(reply.getHeaders())) reply.removeHeader(name)
  return applyProblem(reply, engine.problems, engine.problemOptions, kind === 'outcome-unknown'
    ? { kind, retryAfter: state.settings.retryAfter }
    : { kind })
}

/** Lease mode: records the response; the lease is renewed until this returns (also across the retries). */
async function record (engine: Engine, state: RequestState, response: StoredResponse): Promise<void> {
  const lease = state.lifecycle.lease as Lease
  for (let attempt = 0; ; attempt++) {
    try {
      const since = Date.now()
      const completed = await withTimeout('complete', state.settings.storeTimeout, () => engine.store.complete(lease, response, state.settings.ttl))
      recorded(engine, state, completed, response, since)
      break
    } catch (err) {
      const delay = COMPLETE_RETRY_DELAYS_MS[attempt]
      if (delay === undefined) {
        // The client still gets the true outcome; the key stays in progress until its lease lapses.
        observe(engine.metrics, state, 'store_error', 'error', 'idempotency: could not record the response; the key will be retried after its lease expires', err)
        break
      }
      await new Promise((resolve) => setTimeout(resolve, delay))
    }
  }
  state.lifecycle.settled()
}

/** What the store answered to complete (`since`: when it was asked, for the pre-filter copy's retention). */
function recorded (engine: Engine, state: RequestState, completed: boolean, response: StoredResponse, since: number): void {
  if (completed) {
    observe(engine.metrics, state, 'recorded', 'debug', 'idempotency: response recorded')
    if (state.context !== null) rememberCompleted(engine, state, state.context.fingerprint, response, state.settings.ttl, since)
  } else {
    observe(engine.metrics, state, 'lease_lost', 'warn', 'idempotency: the key was taken over while this request ran; its response was not recorded')
  }
}

/**
 * The outcome will not be recorded. When the answer interrupted a handler that still runs
 * (lib/lifecycle.ts), the key stays held and renewed until it returns, and the failure answer goes
 * out without waiting; a handler that then completed may have produced its effect, so unless it
 * declared otherwise its failure is indeterminate.
 */
function giveUp (engine: Engine, state: RequestState, reason: string): Promise<void> {
  const running = state.lifecycle.interruptedHandler()
  if (running === null) return settleFailure(engine, state, reason)
  observe(engine.metrics, state, 'not_recorded', 'warn', `idempotency: the answer (${reason}) interrupted a handler that still runs; the key stays held until it returns`)
  running.then((outcome) => {
    if (outcome === 'returned' && state.failure === null) state.failure = 'indeterminate'
    return settleFailure(engine, state, outcome === 'returned' ? `${reason}, and the handler completed after it` : reason)
  }).catch(/* c8 ignore next: settleFailure catches */ () => {})
  return Promise.resolve()
}

/**
 * A definite failure (nothing happened) releases the key so a retry runs the operation again. An
 * indeterminate one (an external effect may have happened: declared with markIndeterminate(), or
 * the default once a step completed) keeps the record and its steps in progress for the
 * reconciler: releasing it would discard the recovery points and let a retry repeat steps that
 * already took effect.
 */
async function settleFailure (engine: Engine, state: RequestState, reason: string): Promise<void> {
  const indeterminate = !state.lifecycle.transactional &&
    (state.failure === 'indeterminate' || (state.failure === null && state.stepsCompleted))
  if (!indeterminate) return await release(engine, state, reason)
  clearInFlight(engine, state)
  const store = engine.store
  const lease = state.lifecycle.lease as Lease
  try {
    if (store.hold === undefined) throw new TypeError('the store cannot hold a record for reconciliation (it has no hold())')
    const held = await withTimeout('hold', state.settings.storeTimeout, () => (store.hold as NonNullable<typeof store.hold>)(lease))
    if (held) observe(engine.metrics, state, 'held', 'warn', `idempotency: indeterminate failure (${reason}); key held in progress for reconciliation`)
    else observe(engine.metrics, state, 'lease_lost', 'warn', `idempotency: indeterminate failure (${reason}), but the key was taken over meanwhile`)
  } catch (err) {
    // The record keeps its steps; its lease lapses and a retry takes it over and continues from them.
    observe(engine.metrics, state, 'store_error', 'error', `idempotency: could not hold the key after an indeterminate failure (${reason}); it is taken over by a retry once its lease lapses`, err)
  }
  state.lifecycle.settled()
}

async function release (engine: Engine, state: RequestState, reason: string): Promise<void> {
  clearInFlight(engine, state)
  const lease = state.lifecycle.lease as Lease
  try {
    const released = await withTimeout('release', state.settings.storeTimeout, () => engine.store.release(lease))
    if (released) observe(engine.metrics, state, 'released', 'debug', `idempotency: key released (${reason})`)
    else observe(engine.metrics, state, 'lease_lost', 'warn', `idempotency: nothing to release (${reason}): the key was taken over or force-released meanwhile`)
  } catch (err) {
    observe(engine.metrics, state, 'store_error', 'error', `idempotency: could not release the key (${reason}); it frees itself when its lease expires`, err)
  }
  state.lifecycle.settled()
}
