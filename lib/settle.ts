import type { FastifyReply } from 'fastify'
import { captureStream, classifyPayload, type CapturedPayload } from './capture.js'
import type { RequestState } from './context.js'
import type { Engine } from './engine.js'
import { observe } from './observe.js'
import { pickReplayHeaders } from './headers.js'
import { stopRenewal } from './lease.js'
import { clearInFlight, rememberCompleted } from './prefiltering.js'
import { applyProblem } from './problems.js'
import { deliverEnqueued } from './recovery.js'
import { referenceRecord } from './reference.js'
import type { Lease, StoredResponse } from './store.js'
import { withTimeout } from './timeout.js'
import { localId } from './waiters.js'

/** Recording the outcome is retried briefly: losing it would let a retry execute a second time. */
const COMPLETE_RETRY_DELAYS_MS = [50, 250]

/**
 * onSend of the request that owns the key: records the response before it leaves (for a stream,
 * before its last byte leaves), or releases the key when the outcome is a failure. Returns the
 * payload to send on.
 */
export async function settleOwner (engine: Engine, reply: FastifyReply, state: RequestState, payload: unknown): Promise<unknown> {
  state.phase = 'settling'
  stopRenewal(state)
  const lease = state.lease as Lease
  if (state.errored) {
    await giveUp(engine, state, lease, 'the handler failed')
    return payload
  }

  const captured = classifyPayload(payload, reply)
  const sent = captured.kind === 'stream' ? captured.source : payload
  const statusCode = reply.statusCode
  if (!state.settings.record(statusCode)) {
    await giveUp(engine, state, lease, `status ${statusCode} is not recorded`)
    return sent
  }
  if (captured.kind === 'unsupported') {
    await giveUp(engine, state, lease, 'the payload type cannot be recorded')
    return payload
  }

  // A Buffer is replayed with Fastify's default type for bytes; give the original the same one.
  if (captured.kind === 'stream' && !reply.hasHeader('content-type')) reply.header('content-type', 'application/octet-stream')
  const headers = pickReplayHeaders(reply.getHeaders(), state.settings.replayHeaders)
  const limit = state.settings.maxResponseBytes
  const reference = referenceOf(engine, state, statusCode, headers)
  if (state.transactional) return commitThenSend(engine, reply, state, lease, captured, headers, reference)
  if (reference !== null) {
    // The body is sent as the handler produced it (a stream streams); only the reference is kept.
    await record(engine, state, lease, reference)
    return sent
  }
  if (captured.kind === 'bytes') {
    const body = captured.body.length > limit ? null : captured.body
    await record(engine, state, lease, { statusCode, headers, body })
    return payload
  }
  return captureStream(captured.source, limit, {
    onEnd: (body) => record(engine, state, lease, { statusCode, headers, body }),
    onError: () => giveUp(engine, state, lease, 'the response stream failed')
  })
}

/**
 * onResponse of a request that still owns its key: the response left without passing through
 * onSend (reply.hijack(), a raw write), so there is nothing to record. Released, so the key is
 * not stuck; such routes get concurrency protection only.
 */
export async function releaseUnsent (engine: Engine, state: RequestState): Promise<void> {
  state.phase = 'settling'
  stopRenewal(state)
  observe(engine.metrics, state, 'not_recorded', 'warn', 'idempotency: the response bypassed onSend (reply.hijack() or a raw write), so it cannot be recorded')
  await giveUp(engine, state, state.lease as Lease, 'the response was not sent through Fastify')
}

/**
 * The client went away or the socket timed out. Lease mode: stop renewing; the lease lapses unless
 * the handler still answers. Atomic mode: roll back now, which removes the claim and the handler's
 * writes together (its later queries fail), so a retry can run the operation afresh.
 */
export function abandon (engine: Engine, state: RequestState): void {
  state.abandoned = true
  stopRenewal(state)
  if (state.transactional && state.phase === 'owner') {
    state.phase = 'settling'
    release(engine, state, state.lease as Lease, 'the client went away before the transaction committed').catch(/* c8 ignore next */ () => {})
  }
}

/**
 * Atomic mode: the response is recorded and the transaction committed before a byte is sent, so a
 * client never sees a success that was rolled back. A stream is therefore read whole first (status
 * and headers cannot be taken back once a stream has started). If the commit fails, the client gets
 * a 500 problem instead of the handler's body: nothing of the operation happened.
 */
async function commitThenSend (
  engine: Engine,
  reply: FastifyReply,
  state: RequestState,
  lease: Lease,
  captured: Exclude<CapturedPayload, { kind: 'unsupported' }>,
  headers: Record<string, string | string[]>,
  reference: StoredResponse | null
): Promise<unknown> {
  let body: Buffer
  if (captured.kind === 'bytes') {
    body = captured.body
  } else {
    try {
      body = Buffer.concat(await captured.source.toArray() as Buffer[])
    } catch {
      await release(engine, state, lease, 'the response stream failed')
      return notCommitted(engine, reply)
    }
  }
  const response: StoredResponse = reference ?? { statusCode: reply.statusCode, headers, body: body.length > state.settings.maxResponseBytes ? null : body }
  try {
    const since = Date.now()
    const committed = await withTimeout('complete', state.settings.storeTimeout, () => engine.store.complete(lease, response, state.settings.ttl))
    if (!committed) throw new Error('the transaction no longer owned the record')
    observe(engine.metrics, state, 'recorded', 'debug', 'idempotency: response recorded and transaction committed')
    deliverEnqueued(engine, state)
    if (state.context !== null) rememberCompleted(engine, state, state.context.fingerprint, response, state.settings.ttl, since)
  } catch (err) {
    observe(engine.metrics, state, 'store_error', 'error', 'idempotency: the transaction could not be committed; answering 500', err)
    clearInFlight(engine, state)
    done(engine, state)
    return notCommitted(engine, reply)
  }
  done(engine, state)
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

function notCommitted (engine: Engine, reply: FastifyReply): string {
  for (const name of Object.keys(reply.getHeaders())) reply.removeHeader(name)
  return applyProblem(reply, engine.problems, engine.problemOptions, { kind: 'not-committed' })
}

async function record (engine: Engine, state: RequestState, lease: Lease, response: StoredResponse): Promise<void> {
  for (let attempt = 0; ; attempt++) {
    try {
      const since = Date.now()
      const completed = await withTimeout('complete', state.settings.storeTimeout, () => engine.store.complete(lease, response, state.settings.ttl))
      if (completed) {
        observe(engine.metrics, state, 'recorded', 'debug', 'idempotency: response recorded')
        if (state.context !== null) rememberCompleted(engine, state, state.context.fingerprint, response, state.settings.ttl, since)
      } else {
        observe(engine.metrics, state, 'lease_lost', 'warn', 'idempotency: the key was taken over while this request ran; its response was not recorded')
      }
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
  done(engine, state)
}

/**
 * The outcome will not be recorded. A definite failure (nothing happened) releases the key so a
 * retry runs the operation again. An indeterminate one (an external effect may have happened:
 * declared with markIndeterminate(), or the default once a step completed) keeps the record and its
 * steps in progress for the reconciler: releasing it would discard the recovery points and let a
 * retry repeat steps that already took effect.
 */
async function giveUp (engine: Engine, state: RequestState, lease: Lease, reason: string): Promise<void> {
  const indeterminate = !state.transactional &&
    (state.failure === 'indeterminate' || (state.failure === null && state.stepsCompleted))
  if (!indeterminate) return release(engine, state, lease, reason)
  clearInFlight(engine, state)
  const store = engine.store
  try {
    if (store.hold === undefined) throw new TypeError('the store cannot hold a record for reconciliation (it has no hold())')
    const held = await withTimeout('hold', state.settings.storeTimeout, () => (store.hold as NonNullable<typeof store.hold>)(lease))
    if (held) observe(engine.metrics, state, 'held', 'warn', `idempotency: indeterminate failure (${reason}); key held in progress for reconciliation`)
    else observe(engine.metrics, state, 'lease_lost', 'warn', `idempotency: indeterminate failure (${reason}), but the key was taken over meanwhile`)
  } catch (err) {
    // The record keeps its steps; its lease lapses and a retry takes it over and continues from them.
    observe(engine.metrics, state, 'store_error', 'error', `idempotency: could not hold the key after an indeterminate failure (${reason}); it is taken over by a retry once its lease lapses`, err)
  }
  done(engine, state)
}

async function release (engine: Engine, state: RequestState, lease: Lease, reason: string): Promise<void> {
  clearInFlight(engine, state)
  try {
    await withTimeout('release', state.settings.storeTimeout, () => engine.store.release(lease))
    observe(engine.metrics, state, 'released', 'debug', `idempotency: key released (${reason})`)
  } catch (err) {
    observe(engine.metrics, state, 'store_error', 'error', `idempotency: could not release the key (${reason}); it frees itself when its lease expires`, err)
  }
  done(engine, state)
}

function done (engine: Engine, state: RequestState): void {
  state.phase = 'settled'
  engine.waiters.notify(localId(state.scope, state.key))
}
