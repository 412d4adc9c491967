import type { FastifyReply } from 'fastify'

/**
 * The plugin's own answers, as RFC 9457 problem details. Each kind has its own absolute `type` URI
 * (§3.1.1) and a constant `title` (§3.1.3); the titles are the draft's (§2.7) where it has them.
 * `detail` never echoes the key nor anything recorded for any key (RFC 9457 §5). None of these is
 * ever recorded as a key's outcome.
 */
export type ProblemKind =
  | 'key-missing'
  | 'key-invalid'
  | 'key-reused'
  | 'request-in-progress'
  | 'store-unavailable'
  | 'response-not-retained'
  | 'not-committed'

interface ProblemDefinition {
  readonly status: number
  readonly title: string
  readonly detail: string
}

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
  'response-not-retained': {
    status: 410,
    title: 'Idempotency-Key response was not retained',
    detail: 'The operation for this Idempotency-Key completed, but its response was too large to be recorded, ' +
      'so it cannot be replayed. The operation will not be executed again.'
  }
}

export interface ProblemOptions {
  /** Prefix of every problem `type` URI; the kind is appended. */
  readonly typeBase: string
  /** When set, every problem also carries `Link: <docsUrl>; rel="describedby"` (draft §2.7). */
  readonly docsUrl: string | null
}

/** The serialised bodies, built once at registration: a problem answer is a constant string. */
export type ProblemBodies = Readonly<Record<ProblemKind, string>>

export function buildProblemBodies (options: ProblemOptions): ProblemBodies {
  const bodies = {} as Record<ProblemKind, string>
  for (const kind of Object.keys(PROBLEMS) as ProblemKind[]) {
    const { status, title, detail } = PROBLEMS[kind]
    bodies[kind] = JSON.stringify({ type: options.typeBase + kind, title, status, detail })
  }
  return bodies
}

export interface ProblemAnswer {
  readonly kind: ProblemKind
  /** Occurrence-specific detail replacing the default one. */
  readonly detail?: string
  /** Extension members (RFC 9457 §3.2), e.g. `retryAfter`. */
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
  const { status } = PROBLEMS[answer.kind]
  let body = bodies[answer.kind]
  if (answer.detail !== undefined || answer.extensions !== undefined) {
    const problem = JSON.parse(body) as Record<string, unknown>
    if (answer.detail !== undefined) problem.detail = answer.detail
    Object.assign(problem, answer.extensions)
    body = JSON.stringify(problem)
  }
  reply.code(status)
  reply.header('content-type', 'application/problem+json')
  reply.header('cache-control', 'no-store')
  if (answer.retryAfter !== undefined) reply.header('retry-after', String(answer.retryAfter))
  if (options.docsUrl !== null) reply.header('link', `<${options.docsUrl}>; rel="describedby"; type="text/html"`)
  return body
}
