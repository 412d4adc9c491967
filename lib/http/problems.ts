import type { FastifyReply } from 'fastify'
import type { ProblemKind } from './problem-kind.js'
import { occurrenceBody, renderProblems, type ProblemDefinition, type ProfileName, type RenderedProblem } from './profiles.js'

export type { ProblemKind }

/**
 * The plugin's own answers, as RFC 9457 problem details. Each kind has its own absolute `type` URI
 * (§3.1.1) and a constant `title` (§3.1.3); the titles are the draft's (§2.7) where it has them.
 * `detail` never echoes the key nor anything recorded for any key (RFC 9457 §5). None of these is
 * ever recorded as a key's outcome. The `profile` option may give them another shape (lib/http/profiles.ts).
 */
export const PROBLEMS: Readonly<Record<ProblemKind, ProblemDefinition>> = {
  'key-missing': {
    status: 400,
    title: 'Idempotency-Key is missing',
    detail: 'This operation is idempotent and it requires correct usage of Idempotency Key.'
  },
  'key-invalid': {
    status: 400,
    title: 'Idempotency-Key is invalid',
    detail: 'The Idempotency-Key header is not a valid key.'
  },
  'key-reused': {
    status: 422,
    title: 'Idempotency-Key is already used',
    detail: 'This Idempotency-Key was used with a different request (method, target or body). ' +
      'Idempotency Key MUST not be reused across different payloads of this operation.'
  },
  'request-in-progress': {
    status: 409,
    title: 'A request is outstanding for this Idempotency-Key',
    detail: 'A request with the same Idempotency-Key for the same operation is being processed or is outstanding. ' +
      'Retry the same request later.'
  },
  'store-unavailable': {
    status: 503,
    title: 'Idempotency store is unavailable',
    detail: 'The request was not processed because its Idempotency-Key could not be checked. Retry the same request later.'
  },
  'not-committed': {
    status: 500,
    title: 'Idempotent operation was not committed',
    detail: 'The transaction holding this operation and its Idempotency-Key could not be committed, so nothing was recorded ' +
      'and its writes were rolled back. Retry the same request.'
  },
  // Atomic mode, COMMIT sent but no answer (a dropped connection, storeTimeout): it may have
  // committed or not, and saying either would be a guess. The record decides on the retry.
  'outcome-unknown': {
    status: 503,
    title: 'Idempotent operation outcome is unknown',
    detail: 'The transaction holding this operation and its Idempotency-Key was sent to be committed, but whether it ' +
      'committed could not be confirmed. Retry the same request with the same Idempotency-Key: it replays the recorded ' +
      'response if the operation committed, and runs it if it did not.'
  },
  // Atomic mode, the handler ended the request's transaction itself (COMMIT or ROLLBACK through
  // request.idempotency.sql): its writes may have committed without the record, so the key is held
  // for the reconciler instead of being released or taken over (docs/contract.md).
  'transaction-ended': {
    status: 500,
    title: 'Idempotent operation ended its own transaction',
    detail: 'The transaction holding this operation and its Idempotency-Key was ended by the operation itself, before its ' +
      'response was recorded, so what it wrote may or may not have been kept. The key is held until the service ' +
      'reconciles it; retries with it are answered 409 until then.'
  },
  'response-not-retained': {
    status: 410,
    title: 'Idempotency-Key response was not retained',
    detail: 'The operation for this Idempotency-Key completed, but its response was too large to be recorded, ' +
      'so it cannot be replayed. The operation will not be executed again.'
  },
  // Canonical fingerprints walk the parsed body (lib/core/fingerprint-canonical.ts) under the route's
  // maxBodyDepth and maxBodyNodes, before anything is claimed: nothing is recorded for the key.
  // Too deep is a malformed request for this API (400, RFC 9110 §15.5.1); too many values is
  // content larger than the server is willing to process (413, RFC 9110 §15.5.14).
  'body-too-deep': {
    status: 400,
    title: 'Request body is nested too deeply',
    detail: 'The request body nests arrays and objects deeper than this operation accepts, so it was not processed.'
  },
  'body-too-large': {
    status: 413,
    title: 'Request body holds too many values',
    detail: 'The request body holds more values than this operation accepts, so it was not processed.'
  },
  // The status route's answer for a key the caller has no record of: a key of another scope gets
  // exactly this answer too, so a key's existence never leaks across principals (draft §5).
  'key-unknown': {
    status: 404,
    title: 'Idempotency-Key is unknown',
    detail: 'No request with this Idempotency-Key is recorded for you: it was never used, or its record expired.'
  }
}

export interface ProblemOptions {
  /** Prefix of every problem `type` URI; the kind is appended. */
  readonly typeBase: string
  /** When set, every problem also carries `Link: <docsUrl>; rel="describedby"` (draft §2.7). */
  readonly docsUrl: string | null
  /** The shape of the answers. */
  readonly profile: ProfileName
}

/** Every kind's answer under the registration's profile, built once at registration. */
export type ProblemBodies = Readonly<Record<ProblemKind, RenderedProblem>>

export function buildProblemBodies (options: ProblemOptions): ProblemBodies {
  return renderProblems(options.profile, PROBLEMS, options)
}

export interface ProblemAnswer {
  readonly kind: ProblemKind
  /** Occurrence-specific detail replacing the default one. */
  readonly detail?: string
  /** Extension members (RFC 9457 §3.2), e.g. `originalStatus`; never a name the body already has. */
  readonly extensions?: Readonly<Record<string, unknown>>
  /** Seconds for the `Retry-After` header (RFC 9110 §10.2.3). */
  readonly retryAfter?: number
}

export function sendProblem (
  reply: FastifyReply,
  bodies: ProblemBodies,
  options: ProblemOptions,
  answer: ProblemAnswer
): FastifyReply {
  return reply.send(applyProblem(reply, bodies, options, answer))
}

/** Sets the status and headers of a problem answer on the reply and returns its body. */
export function applyProblem (
  reply: FastifyReply,
  bodies: ProblemBodies,
  options: ProblemOptions,
  answer: ProblemAnswer
): string {
  const problem = bodies[answer.kind]
  const body = answer.detail === undefined && answer.extensions === undefined
    ? problem.body
    : occurrenceBody(problem, answer.detail, answer.extensions)
  reply.code(problem.status)
  reply.header('content-type', problem.contentType)
  reply.header('cache-control', 'no-store')
  for (const [name, value] of problem.headers) reply.header(name, value)
  if (answer.retryAfter !== undefined) reply.header('retry-after', String(answer.retryAfter))
  if (options.docsUrl !== null) reply.header('link', `<${options.docsUrl}>; rel="describedby"; type="text/html"`)
  return body
}
