import t from 'tap'
import { createIdempotentClient, type FetchLike } from '../../client/index.js'

/**
 * The client's own wait between attempts (no `sleep` option): a timer, with or without the
 * caller's AbortSignal. An abort during the wait ends the call at once with the signal's reason,
 * and so does one that came just before the wait began; a wait that ran its course leaves nothing
 * listening on the signal.
 */

/** Answers 503 `times` times, then 201. */
function unavailable (times: number): FetchLike & { calls: number } {
  const fetch = Object.assign(async (): Promise<Response> => {
    fetch.calls++
    return fetch.calls <= times ? new Response('busy', { status: 503 }) : new Response('{"ok":true}', { status: 201, headers: { 'content-type': 'application/json' } })
  }, { calls: 0 })
  return fetch
}

const quick = { baseUrl: 'http://api.test', backoff: { baseMs: 5, maxMs: 5 } }

t.test('without a signal, and with one that is never aborted: the wait runs its course and the call goes on', async (t) => {
  const plain = unavailable(1)
  const answer = await createIdempotentClient({ ...quick, fetch: plain }).post('/pay', { body: {} })
  t.equal(answer.status, 201)
  t.equal(answer.attempts, 2)

  const controller = new AbortController()
  const listening: string[] = []
  const signal = controller.signal
  const add = signal.addEventListener.bind(signal)
  const remove = signal.removeEventListener.bind(signal)
  signal.addEventListener = (...args: Parameters<typeof add>) => { listening.push(args[0]); add(...args) }
  signal.removeEventListener = (...args: Parameters<typeof remove>) => { listening.splice(listening.indexOf(args[0]), 1); remove(...args) }
  const withSignal = unavailable(1)
  const signalled = await createIdempotentClient({ ...quick, fetch: withSignal }).post('/pay', { body: {}, signal })
  t.equal(signalled.status, 201)
  t.same(listening, [], 'every listener the waits and attempts added was removed')
})

t.test('an abort during the wait ends the call with the signal\'s reason; no further attempt', async (t) => {
  const fetch = unavailable(5)
  const controller = new AbortController()
  const client = createIdempotentClient({ baseUrl: 'http://api.test', backoff: { baseMs: 60_000, maxMs: 60_000 }, random: () => 0.5, fetch })
  const call = client.post('/pay', { body: {}, signal: controller.signal })
  setTimeout(() => controller.abort(new Error('user cancelled')), 20)
  await t.rejects(call, { message: 'user cancelled' })
  t.equal(fetch.calls, 1)
})

t.test('an abort just before the wait began ends the call at once', async (t) => {
  const fetch = unavailable(5)
  const controller = new AbortController()
  // random() is drawn for the wait, after the attempt: the abort lands between the two.
  const client = createIdempotentClient({ baseUrl: 'http://api.test', backoff: { baseMs: 60_000, maxMs: 60_000 }, random: () => { controller.abort(new Error('shutting down')); return 0.5 }, fetch })
  const started = Date.now()
  await t.rejects(client.post('/pay', { body: {}, signal: controller.signal }), { message: 'shutting down' })
  t.ok(Date.now() - started < 5000, 'without waiting for the timer')
  t.equal(fetch.calls, 1)
})
