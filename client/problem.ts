/**
 * An RFC 9457 problem details object. `type` defaults to `about:blank` when absent (§3.1.1);
 * extension members (§3.2, e.g. the plugin's `originalStatus`) are kept as sent.
 */
export interface ProblemDetails {
  readonly type: string
  readonly title?: string
  readonly status?: number
  readonly detail?: string
  readonly instance?: string
  readonly [extension: string]: unknown
}

/**
 * The problem in an `application/problem+json` answer, or `null` for any other media type or a body
 * that is not a JSON object. Members of the wrong type are ignored, as §3.1 requires of consumers.
 */
export function parseProblem (headers: Headers, body: Uint8Array): ProblemDetails | null {
  const mediaType = headers.get('content-type')?.split(';', 1)[0]?.trim().toLowerCase()
  if (mediaType !== 'application/problem+json') return null
  let parsed: unknown
  try {
    parsed = JSON.parse(new TextDecoder().decode(body))
  } catch {
    return null
  }
  if (typeof parsed !== 'object' || parsed === null || Array.isArray(parsed)) return null
  const members = parsed as Record<string, unknown>
  const problem: Record<string, unknown> = { ...members, type: typeof members.type === 'string' ? members.type : 'about:blank' }
  for (const name of ['title', 'detail', 'instance'] as const) {
    if (name in problem && typeof problem[name] !== 'string') delete problem[name]
  }
  if ('status' in problem && !Number.isInteger(problem.status)) delete problem.status
  return problem as ProblemDetails
}
