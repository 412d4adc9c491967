/**
 * A small payments API on the embedded default (memory store), hit by a retry storm: many clients
 * send the same logical payments at once and retry on 409 and network errors, reusing each
 * payment's key, as a load balancer or a mobile client on a bad network would. It prints how many
 * charges were created, replayed and refused: exactly one charge per key.
 *
 *   npm run demo                       # defaults: 20 payments × 25 concurrent senders
 *   npm run demo -- --payments 50 --senders 40
 */
import { randomUUID } from 'node:crypto'
import { parseArgs } from 'node:util'
import Fastify from 'fastify'
import idempotency from '../lib/index.js'

const { values } = parseArgs({
  options: {
    payments: { type: 'string', default: '20' },
    senders: { type: 'string', default: '25' },
    port: { type: 'string', default: '0' }
  }
})
const PAYMENTS = Number(values.payments)
const SENDERS = Number(values.senders)

// --- the server: what an application writes -------------------------------------------------
declare module 'fastify' {
  interface FastifyRequest { accountId: string }
}

const app = Fastify()
// The authentication, here an account id a gateway put in a header. A request without one is
// refused: giving every such request one shared scope would let them replay or block each other.
app.decorateRequest('accountId', '')
app.addHook('onRequest', async (request, reply) => {
  const accountId = request.headers['x-account-id']
  if (typeof accountId !== 'string' || accountId === '') return reply.code(401).send({ error: 'unauthenticated' })
  request.accountId = accountId
})
await app.register(idempotency, {
  // Keys belong to the caller: one account cannot replay or block another's payment (draft §5).
  scope: (request) => request.accountId,
  required: true
})

const charges = new Map<string, { id: string, amount: number, currency: string }>()
app.post<{ Body: { amount: number, currency: string } }>('/payments', {
  schema: {
    body: {
      type: 'object',
      required: ['amount', 'currency'],
      properties: { amount: { type: 'integer', minimum: 1 }, currency: { type: 'string', minLength: 3, maxLength: 3 } }
    }
  }
}, async (request, reply) => {
  // The effect: a charge at the card network, which takes a while.
  await new Promise((resolve) => setTimeout(resolve, 30 + Math.random() * 40))
  const charge = { id: `ch_${randomUUID().slice(0, 8)}`, amount: request.body.amount, currency: request.body.currency }
  charges.set(charge.id, charge)
  return reply.code(201).header('location', `/payments/${charge.id}`).send(charge)
})

await app.listen({ host: '127.0.0.1', port: Number(values.port) })
const address = app.server.address()
const url = `http://127.0.0.1:${typeof address === 'object' && address !== null ? address.port : 0}/payments`

// --- the storm: many clients retrying the same logical payments -------------------------------
interface Tally { created: number, replayed: number, refused409: number, rejected422: number, networkRetries: number }
const tally: Tally = { created: 0, replayed: 0, refused409: 0, rejected422: 0, networkRetries: 0 }
const answersByKey = new Map<string, Set<string>>()

async function send (key: string, amount: number): Promise<void> {
  for (let attempt = 0; attempt < 100; attempt++) {
    let response: Response
    try {
      response = await fetch(url, {
        method: 'POST',
        headers: { 'content-type': 'application/json', 'idempotency-key': `"${key}"`, 'x-account-id': 'acct_demo' },
        body: JSON.stringify({ amount, currency: 'EUR' })
      })
    } catch {
      tally.networkRetries++
      continue
    }
    const body = await response.text()
    if (response.status === 409) {
      tally.refused409++
      // Retry-After says 1 s; the demo shortens it so the storm finishes quickly.
      await new Promise((resolve) => setTimeout(resolve, 20 + Math.random() * 30))
      continue
    }
    if (response.status === 422) { tally.rejected422++; return }
    if (response.headers.get('idempotent-replayed') === 'true') tally.replayed++
    else tally.created++
    answersByKey.get(key)?.add(body)
    return
  }
}

const keys = Array.from({ length: PAYMENTS }, () => randomUUID())
for (const key of keys) answersByKey.set(key, new Set())
const started = performance.now()
await Promise.all(keys.flatMap((key, i) => [
  ...Array.from({ length: SENDERS }, () => send(key, 1000 + i)),
  // A buggy client reusing the key for a different amount: refused with 422, never charged.
  send(key, 1)
]))
const elapsed = performance.now() - started

const consistent = [...answersByKey.values()].every((answers) => answers.size === 1)
console.log(`fastify-idempotency demo: ${PAYMENTS} payments, ${SENDERS} concurrent senders each, plus one key reuse each (${(elapsed / 1000).toFixed(2)} s)`)
console.table({
  'payments (keys)': PAYMENTS,
  'charges created': charges.size,
  'answered by executing': tally.created,
  'answered by replay': tally.replayed,
  'refused while in flight (409)': tally.refused409,
  'refused, key reused with another amount (422)': tally.rejected422
})
const ok = charges.size === PAYMENTS && tally.created === PAYMENTS && consistent
console.log(ok
  ? 'one charge per key: OK (every client of a key received the same body)'
  : `FAILED: ${charges.size} charges for ${PAYMENTS} keys (consistent answers: ${consistent})`)
await app.close()
process.exitCode = ok ? 0 : 1
