import { parseProblem, type ProblemDetails } from './problem.js'

/** The final answer to a logical operation, its body read whole. */
export interface IdempotentResponse {
  readonly status: number
  /** `status` is 2xx. */
  readonly ok: boolean
  readonly headers: Headers
  readonly body: Uint8Array
  /**
   * The server answered from its record of an earlier attempt (`Idempotent-Replayed: true`): the
   * operation ran once, on an attempt whose answer never arrived or on an earlier call with this key.
   */
  readonly replayed: boolean
  /** Attempts made, this one included. */
  readonly attempts: number
  /** The key every attempt carried, or `null` for an idempotent method sent without one. */
  readonly key: string | null
  /** The parsed RFC 9457 problem when the answer is `application/problem+json`, else `null`. */
  readonly problem: ProblemDetails | null
  text (): string
  json<T = unknown> (): T
}

export function isReplay (headers: Headers): boolean {
  return headers.get('idempotent-replayed')?.trim().toLowerCase() === 'true'
}

export function buildResponse (response: Response, body: Uint8Array, attempts: number, key: string | null): IdempotentResponse {
  const { status, headers } = response
  return {
    status,
    ok: status >= 200 && status <= 299,
    headers,
    body,
    replayed: isReplay(headers),
    attempts,
    key,
    problem: parseProblem(headers, body),
    text: () => new TextDecoder().decode(body),
    json: <T>() => JSON.parse(new TextDecoder().decode(body)) as T
  }
}
