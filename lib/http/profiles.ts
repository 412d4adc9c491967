import type { ProblemKind } from './problem-kind.js'

/**
 * The shape of the plugin's own error answers, chosen once per registration:
 * - `'ietf'`: RFC 9457 problem details, with the draft's statuses (§2.7: 400, 409, 422);
 * - `'stripe'`: Stripe's error object (`{ "error": { "type", "code"?, "message" } }`, `application/json`)
 *   and statuses, with `Stripe-Should-Retry`, so clients written against a Stripe-like API (and
 *   Stripe's SDKs, which take any JSON body without an `error` member for a result) keep working.
 */
export type ProfileName = 'ietf' | 'stripe'

export const PROFILE_NAMES: readonly ProfileName[] = ['ietf', 'stripe']

/** A kind as RFC 9457 describes it (status, constant title, default detail): the `'ietf'` profile's answer. */
export interface ProblemDefinition {
  readonly status: number
  readonly title: string
  readonly detail: string
}

export interface RenderOptions {
  /** Prefix of every problem `type` URI (`'ietf'`). */
  readonly typeBase: string
  /** Documentation URL: `doc_url` of every Stripe error (`'stripe'`). */
  readonly docsUrl: string | null
}

/**
 * One kind's answer under one profile, serialised at registration. The body is split around the
 * detail (message) so an occurrence's own detail and extension members are spliced in without
 * parsing or re-serialising the body.
 */
export interface RenderedProblem {
  readonly status: number
  readonly contentType: string
  /** Headers this profile adds to this kind (lower-case names). */
  readonly headers: ReadonlyArray<readonly [string, string]>
  /** The whole default body. */
  readonly body: string
  /** Everything before the detail value. */
  readonly head: string
  /** The default detail, already a JSON string literal. */
  readonly detail: string
  /** Everything after the detail value (and after any extension members). */
  readonly tail: string
  /** How an extension member's name is spelled in this profile's body. */
  readonly memberName: (name: string) => string
}

type StripeErrorType = 'invalid_request_error' | 'idempotency_error' | 'api_error'

interface StripeError {
  readonly status: number
  readonly type: StripeErrorType
  /** Only where Stripe documents a code for the same situation. */
  readonly code?: string
  readonly message: string
  /** `Stripe-Should-Retry`: what Stripe's SDKs obey before looking at the status. */
  readonly shouldRetry: boolean
}

/**
 * Stripe's answers (docs.stripe.com/api/errors, /error-codes, /api/idempotent_requests; the SDKs'
 * retry rules). Stripe sends the key in two of these messages; ours never contain it (RFC 9457 §5
 * still applies to what we write). Kinds Stripe has no counterpart for keep the IETF profile's
 * status, with the Stripe type whose meaning fits (`api_error` for 5xx).
 */
const STRIPE: Readonly<Record<ProblemKind, StripeError>> = {
  'key-missing': {
    status: 400,
    type: 'invalid_request_error',
    message: 'This request requires an Idempotency-Key header.',
    shouldRetry: false
  },
  'key-invalid': {
    status: 400,
    type: 'invalid_request_error',
    message: 'The Idempotency-Key header is not a valid key.',
    shouldRetry: false
  },
  // Stripe answers a reused key with 400 and type idempotency_error, without a code.
  'key-reused': {
    status: 400,
    type: 'idempotency_error',
    message: 'Keys for idempotent requests can only be used with the same parameters they were first used with. ' +
      'Try using a key other than the one you sent if you meant to execute a different request.',
    shouldRetry: false
  },
  // 409 is retried by every official Stripe SDK, with or without the header.
  'request-in-progress': {
    status: 409,
    type: 'idempotency_error',
    code: 'idempotency_key_in_use',
    message: 'There is currently another in-progress request using this idempotency key (that probably means you ' +
      'submitted twice, and the other request is still going through). Please try again later.',
    shouldRetry: true
  },
  'store-unavailable': {
    status: 503,
    type: 'api_error',
    message: 'The request was not processed because its idempotency key could not be checked. Please try again later.',
    shouldRetry: true
  },
  // The SDKs retry 5xx unless told not to; here nothing was kept, so retrying is what the client should do.
  'not-committed': {
    status: 500,
    type: 'api_error',
    message: 'The operation for this idempotency key could not be committed, so nothing was recorded and its writes ' +
      'were rolled back. Retry the same request.',
    shouldRetry: true
  },
  'outcome-unknown': {
    status: 503,
    type: 'api_error',
    message: 'The operation for this idempotency key was sent to be committed, but whether it committed could not be ' +
      'confirmed. Retry the same request with the same idempotency key.',
    shouldRetry: true
  },
  // Retried like every 5xx: a retry is answered 409 until the key is reconciled, then replayed.
  'transaction-ended': {
    status: 500,
    type: 'api_error',
    message: 'The operation for this idempotency key ended its own transaction before its response was recorded. ' +
      'The key is held until the service reconciles it.',
    shouldRetry: true
  },
  'response-not-retained': {
    status: 410,
    type: 'idempotency_error',
    message: 'The operation for this idempotency key completed, but its response was too large to be recorded, so it ' +
      'cannot be replayed. The operation will not be executed again.',
    shouldRetry: false
  },
  // No Stripe counterpart: its request-validation type, with our statuses.
  'body-too-deep': {
    status: 400,
    type: 'invalid_request_error',
    message: 'The request body nests arrays and objects deeper than this operation accepts, so it was not processed.',
    shouldRetry: false
  },
  'body-too-large': {
    status: 413,
    type: 'invalid_request_error',
    message: 'The request body holds more values than this operation accepts, so it was not processed.',
    shouldRetry: false
  },
  // Stripe's answer to an object id it does not know (in the caller's account).
  'key-unknown': {
    status: 404,
    type: 'invalid_request_error',
    code: 'resource_missing',
    message: 'No such idempotency key.',
    shouldRetry: false
  }
}

const NO_HEADERS: ReadonlyArray<readonly [string, string]> = Object.freeze([])
const SHOULD_RETRY = Object.freeze([['stripe-should-retry', 'true'] as const])
const SHOULD_NOT_RETRY = Object.freeze([['stripe-should-retry', 'false'] as const])

const unchanged = (name: string): string => name
/** Stripe's members are snake_case (`original_status`). */
const snakeCase = (name: string): string => name.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`)

/** Every kind's answer under `profile`; called once per registration. */
export function renderProblems (
  profile: ProfileName,
  definitions: Readonly<Record<ProblemKind, ProblemDefinition>>,
  options: RenderOptions
): Readonly<Record<ProblemKind, RenderedProblem>> {
  const rendered = {} as Record<ProblemKind, RenderedProblem>
  for (const kind of Object.keys(definitions) as ProblemKind[]) {
    rendered[kind] = profile === 'stripe'
      ? renderStripe(STRIPE[kind], options)
      : renderIetf(kind, definitions[kind], options)
  }
  return Object.freeze(rendered)
}

/** Byte for byte what `JSON.stringify({ type, title, status, detail })` gives (RFC 9457 §3.1). */
function renderIetf (kind: ProblemKind, definition: ProblemDefinition, options: RenderOptions): RenderedProblem {
  const head = `{"type":${JSON.stringify(options.typeBase + kind)},"title":${JSON.stringify(definition.title)},` +
    `"status":${definition.status},"detail":`
  return rendered(definition.status, 'application/problem+json', NO_HEADERS, head, JSON.stringify(definition.detail), '}', unchanged)
}

/** Stripe's members in Stripe's (alphabetical) order: code, doc_url, message, type. */
function renderStripe (error: StripeError, options: RenderOptions): RenderedProblem {
  let head = '{"error":{'
  if (error.code !== undefined) head += `"code":${JSON.stringify(error.code)},`
  if (options.docsUrl !== null) head += `"doc_url":${JSON.stringify(options.docsUrl)},`
  head += '"message":'
  const tail = `,"type":${JSON.stringify(error.type)}}}`
  return rendered(error.status, 'application/json', error.shouldRetry ? SHOULD_RETRY : SHOULD_NOT_RETRY,
    head, JSON.stringify(error.message), tail, snakeCase)
}

function rendered (
  status: number,
  contentType: string,
  headers: ReadonlyArray<readonly [string, string]>,
  head: string,
  detail: string,
  tail: string,
  memberName: (name: string) => string
): RenderedProblem {
  return Object.freeze({ status, contentType, headers, body: head + detail + tail, head, detail, tail, memberName })
}

/**
 * The body of one occurrence: its own detail (or the default) and extension members (RFC 9457
 * §3.2) spliced between the pre-built parts; only the spliced values are serialised. Extension
 * names must not repeat a member the profile already writes.
 */
export function occurrenceBody (
  problem: RenderedProblem,
  detail: string | undefined,
  extensions: Readonly<Record<string, unknown>> | undefined
): string {
  let body = problem.head + (detail === undefined ? problem.detail : JSON.stringify(detail))
  if (extensions !== undefined) {
    for (const name of Object.keys(extensions)) {
      const value = JSON.stringify(extensions[name])
      // As JSON.stringify would on the whole object: a member without a JSON value is left out.
      if (value !== undefined) body += `,${JSON.stringify(problem.memberName(name))}:${value}`
    }
  }
  return body + problem.tail
}
