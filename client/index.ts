/**
 * `fastify-idempotency/client`: a retrying `fetch` client for APIs that honour `Idempotency-Key`.
 * It imports nothing from the server side (no Fastify), so API consumers can use it alone.
 *
 * @example
 * import { createIdempotentClient } from 'fastify-idempotency/client'
 *
 * const client = createIdempotentClient({ baseUrl: 'https://api.example.com', timeoutMs: 10_000 })
 * const result = await client.post('/payments', { body: { amount: 100 }, headers: { authorization } })
 * result.status; result.replayed; result.attempts; result.key; result.json()
 */
export { createIdempotentClient, type IdempotentClient, type RequestOptions } from './client.js'
export { InvalidOptionError, NoAnswerError, ResponseTooLargeError } from './errors.js'
export type { BackoffOptions, FetchLike, IdempotentClientOptions, Sleep } from './options.js'
export type { JsonValue, RequestBody } from './body.js'
export type { RedirectMode } from './redirect.js'
export type { ProblemDetails } from './problem.js'
export type { IdempotentResponse } from './response.js'
