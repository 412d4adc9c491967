/**
 * The client helper against a small payments API (the plugin on the memory store), run in-process:
 *
 *   npx tsx examples/client.ts
 *
 * The first charge is slower than the client's per-attempt timeout: the attempt is abandoned while
 * the server goes on and commits. The retry carries the same key, waits for the original and gets
 * its recorded answer back, `replayed: true`: one charge. Reusing that key for a different payment
 * is refused with a 422 problem.
 *
 * In an application: `import { createIdempotentClient } from 'fastify-idempotency/client'`.
 */
import Fastify from 'fastify'
import idempotency from '../lib/index.js'
import { createIdempotentClient, NoAnswerError } from '../client/index.js'

// --- a payments API whose card network is slow on the first charge -------------------------
const app = Fastify()
await app.register(idempotency, { scope: () => 'demo-account', required: true, wait: 2_000 })
let charges = 0
app.post<{ Body: { amount: number } }>('/payments', async (request, reply) => {
  charges++
  if (charges === 1) await new Promise((resolve) => setTimeout(resolve, 300))
  return reply.code(201).send({ id: `ch_${charges}`, amount: request.body.amount })
})
const baseUrl = await app.listen({ host: '127.0.0.1', port: 0 })

// --- the client ---------------------------------------------------------------------------------
const client = createIdempotentClient({ baseUrl, timeoutMs: 200, maxAttempts: 5, backoff: { baseMs: 100, maxMs: 2_000 } })

try {
  const payment = await client.post('/payments', { body: { amount: 1000 } })
  console.log('status %d, replayed %s, after %d attempts, key %s', payment.status, payment.replayed, payment.attempts, payment.key)
  console.log('body', payment.json(), '| charges made:', charges)

  const misuse = await client.post('/payments', { key: payment.key ?? undefined, body: { amount: 5 } })
  console.log('same key, other body → %d %s', misuse.status, misuse.problem?.title)
} catch (err) {
  // No attempt got an answer: the outcome is unknown, so keep the key and retry with it later.
  if (err instanceof NoAnswerError) console.error('no answer; retry later with key', err.key)
  throw err
} finally {
  await app.close()
}
