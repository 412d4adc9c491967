import type { FastifyReply } from 'fastify'
import { captureStream, classifyPayload, type CapturedPayload } from './capture.js'
import type { RequestState } from './context.js'
import { decision, type Engine } from './engine.js'
import { pickReplayHeaders } from './headers.js'
import { stopRenewal } from './lease.js'
import { clearInFlight, rememberCompleted } from './prefiltering.js'
import { applyProblem } from './problems.js'
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
    await release(engine, state, lease, 'the handler failed')
    return payload
  }

  const captured = classifyPayload(payload, reply)
  const sent = captured.kind === 'stream' ? captured.source : payload
  const statusCode = reply.statusCode
  if (!state.settings.record(statusCode)) {
    await release(engine, state, lease, `status ${statusCode} is not recorded`)
    return sent
  }
  if (captured.kind === 'unsupported') {
    await release(engine, state, lease, 'the payload type cannot be recorded')
    return payload
  }

  // A Buffer is replayed with Fastify's default type for bytes; give the original the same one.
  if (captured.kind === 'stream' && !reply.hasHeader('content-type')) reply.header('content-type', 'application/octet-stream')
  const headers = pickReplayHeaders(reply.getHeaders(), state.settings.replayHeaders)
  const limit = state.settings.maxResponseBytes
  if (state.transactional) return commitThenSend(engine, reply, state, lease, captured, headers)
  if (captured.kind === 'bytes') {
    const body = captured.body.length > limit ? null : captured.body
    await record(engine, state, lease, { statusCode, headers, body })
    return payload
  }
  return captureStream(captured.source, limit, {
    onEnd: (body) => record(engine, state, lease, { statusCode, headers, body }),
    onError: () => release(engine, state, lease, 'the response stream failed')
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
  state.log.warn(decision(state, 'released'), 'idempotency: the response bypassed onSend (reply.hijack() or a raw write), so it cannot be recorded; key released')
  await release(engine, state, state.lease as Lease, 'the response was not sent through Fastify')
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
  headers: Record<string, string | string[]>
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
  const response: StoredResponse = { statusCode: reply.statusCode, headers, body: body.length > state.settings.maxResponseBytes ? null : body }
  try {
    const since = Date.now()
    const committed = await withTimeout('complete', state.settings.storeTimeout, () => engine.store.complete(lease, response, state.settings.ttl))
    if (!committed) throw new Error('the transaction no longer owned the record')
    state.log.debug(decision(state, 'recorded'), 'idempotency: response recorded and transaction committed')
    if (state.context !== null) rememberCompleted(engine, state, state.context.fingerprint, response, state.settings.ttl, since)
  } catch (err) {
    state.log.error({ ...decision(state, 'store_error'), err }, 'idempotency: the transaction could not be committed; answering 500')
    clearInFlight(engine, state)
    done(engine, state)
    return notCommitted(engine, reply)
  }
  done(engine, state)
  return captured.kind === 'bytes' ? undefined : body
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
        state.log.debug(decision(state, 'recorded'), 'idempotency: response recorded')
        if (state.context !== null) rememberCompleted(engine, state, state.context.fingerprint, response, state.settings.ttl, since)
      } else {
        state.log.warn(decision(state, 'lease_lost'), 'idempotency: the key was taken over while this request ran; its response was not recorded')
      }
      break
    } catch (err) {
      const delay = COMPLETE_RETRY_DELAYS_MS[attempt]
      if (delay === undefined) {
        // The client still gets the true outcome; the key stays in progress until its lease lapses.
        state.log.error({ ...decision(state, 'store_error'), err }, 'idempotency: could not record the response; the key will be retried after its lease expires')
        break
      }
      await new Promise((resolve) => setTimeout(resolve, delay))
    }
  }
  done(engine, state)
}

async function release (engine: Engine, state: RequestState, lease: Lease, reason: string): Promise<void> {
  clearInFlight(engine, state)
  try {
    await withTimeout('release', state.settings.storeTimeout, () => engine.store.release(lease))
    state.log.debug(decision(state, 'released'), `idempotency: key released (${reason})`)
  } catch (err) {
    state.log.error({ ...decision(state, 'store_error'), err }, `idempotency: could not release the key (${reason}); it frees itself when its lease expires`)
  }
  done(engine, state)
}

function done (engine: Engine, state: RequestState): void {
  state.phase = 'settled'
  engine.waiters.notify(localId(state.scope, state.key))
}
