import t from 'tap'
import { createIdempotentClient, NoAnswerError, type FetchLike } from '../../client/index.js'

/**
 * How the client gives up when no attempt got an answer: a NoAnswerError that says why (the
 * attempts ran out, or the deadline did), how many attempts were made (one is "1 attempt"), and
 * what the last one failed with, whatever was thrown. The deadline is checked before each attempt
 * too: a wait that outlasted it ends the call without another attempt.
 */

const failing = (reason: unknown): FetchLike => async () => { throw reason }

t.test('one attempt that failed: "after 1 attempt", with the failure\'s message', async (t) => {
  const client = createIdempotentClient({ baseUrl: 'http://api.test', maxAttempts: 1, fetch: failing(new TypeError('fetch failed')) })
  const error = await client.post('/pay', { body: {} }).catch((err: unknown) => err) as NoAnswerError
  t.ok(error instanceof NoAnswerError)
  t.equal(error.message, 'fastify-idempotency/client: no answer to POST http://api.test/pay after 1 attempt: fetch failed')
  t.match(error, { reason: 'attempts', attempts: 1 })
  t.equal(typeof error.key, 'string', 'the key to resume with')
})

t.test('a failure that is not an Error is named as it was thrown', async (t) => {
  const client = createIdempotentClient({ baseUrl: 'http://api.test', maxAttempts: 2, sleep: async () => {}, fetch: failing('socket hang up') })
  const error = await client.post('/pay', { body: {} }).catch((err: unknown) => err) as NoAnswerError
  t.equal(error.message, 'fastify-idempotency/client: no answer to POST http://api.test/pay after 2 attempts: socket hang up')
  t.equal(error.cause, 'socket hang up')
})

t.test('the deadline ends the call: before a wait it would outlast, and after a wait that outlasted it', async (t) => {
  // The next wait would end past the deadline: given up after the one attempt.
  let clock = 0
  const short = createIdempotentClient({
    baseUrl: 'http://api.test',
    deadlineMs: 100,
    backoff: { baseMs: 1000, maxMs: 1000 },
    random: () => 0.5,
    now: () => clock,
    fetch: failing(new Error('reset'))
  })
  const first = await short.post('/pay', { body: {} }).catch((err: unknown) => err) as NoAnswerError
  t.equal(first.message, 'fastify-idempotency/client: no answer to POST http://api.test/pay within the deadline (1 attempt): reset')
  t.match(first, { reason: 'deadline', attempts: 1 })

  // The wait was shorter than what was left, but took longer (a suspended process): no attempt after it.
  let fetches = 0
  const slept = createIdempotentClient({
    baseUrl: 'http://api.test',
    deadlineMs: 1000,
    backoff: { baseMs: 10, maxMs: 10 },
    now: () => clock,
    sleep: async () => { clock += 5000 },
    fetch: async () => { fetches++; throw new Error('reset') }
  })
  const second = await slept.post('/pay', { body: {} }).catch((err: unknown) => err) as NoAnswerError
  t.match(second, { reason: 'deadline', attempts: 1 })
  t.equal(fetches, 1, 'no attempt once the deadline had passed')
})
