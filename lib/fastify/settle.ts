import { validateHeaderName, validateHeaderValue } from 'node:http'
import type { FastifyReply } from 'fastify'
import { observe } from '../core/observe.js'
import { conclude, record } from '../core/outcome.js'
import { commitRecord, decide, type CommitFailure } from '../core/settle.js'
import type { StoredResponse } from '../core/store.js'
import type { HttpEngine } from '../http/engine.js'
import { pickReplayHeaders } from '../http/headers.js'
import { applyProblem } from '../http/problems.js'
import { referenceRecord } from '../http/reference.js'
import { captureStream, classifyPayload, type CapturedPayload } from './capture.js'
import type { FastifyRequestState } from './request-state.js'

/**
 * onSend of the request that owns the key (the lifecycle moved it to `settling`): records the
 * response before it leaves (for a stream, before its last byte leaves), or releases or holds the
 * key, as the lifecycle decides (lib/core/lifecycle.ts, the fate table). Returns the payload to send on:
 * at once when the store answered directly (lib/core/store.ts), else a promise of it. Whatever goes wrong
 * in here (a bug, a payload that cannot be captured), the key is recorded, held or released, never
 * stranded in progress, and never released once the handler returned an answer.
 */
export function settleOwner (engine: HttpEngine, reply: FastifyReply, state: FastifyRequestState, payload: unknown): unknown {
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

async function settleFailed (engine: HttpEngine, state: FastifyRequestState, payload: unknown, err: unknown): Promise<unknown> {
  try {
    observe(engine.metrics, state, 'settle_failed', 'error', 'idempotency: unexpected error while settling the response; it is not recorded', err)
    // Unless the answer was already a failure, the handler returned: its effect may have happened.
    if (state.lifecycle.phase === 'settling') await decide(engine, state, state.lifecycle.threw ? 'threw' : 'unrecordable', 'an unexpected error while settling the response')
    return payload
  } finally {
    state.lifecycle.responded()
  }
}

/**
 * The payload to send on, or a promise of it; what it cannot do at once it does through promises.
 * While the store is asked, the answer's status is kept: a handler that an answer interrupted (a
 * handlerTimeout) may still call reply.code() on its way out, and the status of the answer being
 * settled must not become its.
 */
function settle (engine: HttpEngine, reply: FastifyReply, state: FastifyRequestState, payload: unknown): unknown {
  if (state.lifecycle.threw) {
    const failedWith = reply.statusCode
    return decide(engine, state, 'threw', 'the handler failed').then(() => keepStatus(reply, failedWith, payload))
  }

  // A fetch Response sets its status here.
  const captured = classifyPayload(payload, reply)
  const sent = captured.kind === 'stream' ? captured.source : payload
  const statusCode = reply.statusCode
  if (!recordsStatus(engine, state, statusCode)) return decide(engine, state, 'not-recorded', `status ${statusCode} is not recorded`).then(() => keepStatus(reply, statusCode, sent))
  if (captured.kind === 'unsupported') {
    observe(engine.metrics, state, 'not_recorded', 'error', 'idempotency: the payload type cannot be recorded')
    // Fastify refuses it and answers an error of its own: its status is Fastify's to choose.
    return decide(engine, state, 'unrecordable', 'the payload type cannot be recorded').then(() => payload)
  }
  // Node refuses such a response in writeHead, after onSend, and Fastify then answers 500: the
  // client never receives it, so it must not become the key's outcome.
  let replyHeaders = reply.getHeaders()
  const unsendable = unsendableHeader(replyHeaders)
  if (unsendable !== null) {
    observe(engine.metrics, state, 'not_recorded', 'error', `idempotency: the response has a header Node cannot send (${unsendable}); it is not recorded`)
    return decide(engine, state, 'unrecordable', 'the response cannot be sent').then(() => sent)
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
  if (reference !== null) return recordThen(engine, reply, state, reference, sent)
  if (captured.kind === 'bytes') return recordThen(engine, reply, state, { statusCode, headers, body: captured.body.length > limit ? null : captured.body }, payload)
  return captureStream(captured.source, limit, {
    onEnd: async (body) => { await record(engine, state, { statusCode, headers, body }) },
    onError: () => decide(engine, state, 'unrecordable', 'the response stream failed')
  })
}

/** `value`, with the reply's status set back to `statusCode` if something changed it meanwhile. */
function keepStatus<T> (reply: FastifyReply, statusCode: number, value: T): T {
  if (reply.statusCode !== statusCode) reply.code(statusCode)
  return value
}

/**
 * The route's `record` rule for the status. A rule that throws cannot say "do not record": the
 * handler returned this answer and the client gets it, so it is recorded (releasing the key would
 * let a retry run the operation a second time).
 */
function recordsStatus (engine: HttpEngine, state: FastifyRequestState, statusCode: number): boolean {
  try {
    return state.settings.record(statusCode)
  } catch (err) {
    observe(engine.metrics, state, 'settle_failed', 'error', `idempotency: the route's record rule threw for status ${statusCode}; the answer is recorded`, err)
    return true
  }
}

/** Records `response`, then hands `sent` back: at once when the store answered directly, else once recorded. */
function recordThen (engine: HttpEngine, reply: FastifyReply, state: FastifyRequestState, response: StoredResponse, sent: unknown): unknown {
  const recorded = record(engine, state, response)
  return recorded === undefined ? sent : recorded.then(() => keepStatus(reply, response.statusCode, sent))
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
export async function releaseUnsent (engine: HttpEngine, state: FastifyRequestState): Promise<void> {
  if (!state.lifecycle.unsent()) return
  observe(engine.metrics, state, 'not_recorded', 'warn', 'idempotency: the response bypassed onSend (reply.hijack() or a raw write), so it cannot be recorded')
  await decide(engine, state, 'unsent', 'the response was not sent through Fastify')
}

/**
 * Atomic mode, the client went away before the answer was committed: roll back now, which removes
 * the claim and the handler's writes together (its later queries fail), so a retry runs the
 * operation afresh. Lease mode: nothing to do (see lib/core/lifecycle.ts).
 */
export function rollBackForDepartedClient (engine: HttpEngine, state: FastifyRequestState): void {
  if (state.lifecycle.clientLeft()) {
    conclude(engine, state, 'release', 'the client went away before the transaction committed').catch(/* c8 ignore next: conclude reports the store's failures itself */ () => {})
  }
}

/**
 * Atomic mode: the response is recorded and the transaction committed before a byte is sent, so a
 * client never sees a success that was rolled back. A stream is therefore read whole first (status
 * and headers cannot be taken back once a stream has started). If the commit failed, the client gets
 * a 500 problem instead of the handler's body: nothing of the operation happened. If the store cannot
 * tell (the connection dropped or timed out after COMMIT was sent), it gets a 503 that says so: the
 * retry replays the committed response or runs the operation afresh, whichever is true. If the
 * handler ended the transaction itself, the store held the key, and the client gets a 500 that says so.
 */
async function commitThenSend (
  engine: HttpEngine,
  reply: FastifyReply,
  state: FastifyRequestState,
  captured: Exclude<CapturedPayload, { kind: 'unsupported' }>,
  headers: Record<string, string | string[]>,
  reference: StoredResponse | null
): Promise<unknown> {
  let body: Buffer
  if (captured.kind === 'bytes') {
    body = captured.body
  } else {
    try {
      const chunks = await captured.source.toArray() as Array<Buffer | string>
      body = Buffer.concat(chunks.map((chunk) => typeof chunk === 'string' ? Buffer.from(chunk) : chunk))
    } catch (err) {
      observe(engine.metrics, state, 'not_recorded', 'error', 'idempotency: the response stream failed before its end; the transaction is rolled back', err)
      await conclude(engine, state, 'release', 'the response stream failed')
      return notCommitted(engine, reply, state, 'not-committed')
    }
  }
  const statusCode = reply.statusCode
  const response: StoredResponse = reference ?? { statusCode, headers, body: body.length > state.settings.maxResponseBytes ? null : body }
  const failed = await commitRecord(engine, state, response)
  if (failed !== null) return notCommitted(engine, reply, state, failed.failure)
  // The committed answer's status, whatever a handler still running set meanwhile.
  if (reply.statusCode !== statusCode) reply.code(statusCode)
  return captured.kind === 'bytes' ? undefined : body
}

/**
 * The record of a response by reference, when the route rebuilds replays (`rebuild`) and the handler
 * set `request.idempotency.reference`; null to record the body as usual.
 */
function referenceOf (engine: HttpEngine, state: FastifyRequestState, statusCode: number, headers: Record<string, string | string[]>): StoredResponse | null {
  const reference = state.context?.reference
  if (state.settings.rebuild === null || reference === undefined) return null
  const response = referenceRecord(statusCode, headers, reference)
  if (response === null) {
    observe(engine.metrics, state, 'not_recorded', 'error', 'idempotency: request.idempotency.reference is not JSON-serializable; recording the response body instead')
  }
  return response
}

function notCommitted (engine: HttpEngine, reply: FastifyReply, state: FastifyRequestState, kind: CommitFailure): string {
  for (const name of Object.keys(reply.getHeaders())) reply.removeHeader(name)
  return applyProblem(reply, engine.problems, engine.problemOptions, kind === 'outcome-unknown'
    ? { kind, retryAfter: state.settings.retryAfter }
    : { kind })
}
