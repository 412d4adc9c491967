import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore } from '../../lib/index.js'
import { appliedWait, preferredWait } from '../../lib/http/prefer.js'
import { sleep } from '../helpers/sleep.js'

/**
 * `Prefer: wait=N` (RFC 7240 §4.3): a duplicate whose client asks for a wait waits at most that
 * long for its original, never longer than the route's `wait`, and its answer says what it got in
 * `Preference-Applied`. Without the preference, or on a route that does not wait, nothing changes.
 */

t.test('the wait preference: read from the first wait, in seconds; anything unreadable is none', async (t) => {
  t.equal(preferredWait(undefined), null)
  t.equal(preferredWait('wait=3'), 3_000)
  t.equal(preferredWait('respond-async, WAIT = 0'), 0, 'case-insensitive, spaces around =')
  t.equal(preferredWait('wait="2"'), 2_000, 'a quoted-string value')
  t.equal(preferredWait(['return=minimal', 'wait=4; foo=bar', 'wait=9']), 4_000, 'several headers are one list; the first wait counts')
  t.equal(preferredWait('return=minimal'), null, 'no wait preference')
  for (const unreadable of ['wait', 'wait=', 'wait=-1', 'wait=1.5', 'wait=abc', 'wait=12345678901']) t.equal(preferredWait(unreadable), null, unreadable)
  t.equal(preferredWait('wait=9999999999'), 2_147_483_000, 'a long wait is bounded')
  t.equal(appliedWait(3_000, 5_000), 'wait=3')
  t.equal(appliedWait(10_000, 2_500), 'wait=2', 'capped at the route\'s wait, in whole seconds')
})

interface World {
  readonly app: FastifyInstance
  readonly runs: () => number
  /** Lets the handler in flight answer. */
  readonly finish: () => void
}

async function world (t: Test, wait: number): Promise<World> {
  const app = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store: memoryStore({ purgeInterval: 0 }), scope: () => 'acct', wait })
  let runs = 0
  let finish: () => void = () => {}
  app.post('/pay', async () => {
    runs++
    await new Promise<void>((resolve) => { finish = resolve })
    return { run: runs }
  })
  await app.ready()
  return { app, runs: () => runs, finish: () => { finish() } }
}

const pay = (app: FastifyInstance, prefer?: string) =>
  app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': '"k"', ...(prefer === undefined ? {} : { prefer }) }, payload: {} })

t.test('wait=0 on a route that waits 5 s: 409 at once, saying wait=0', async (t) => {
  const w = await world(t, 5_000)
  const original = pay(w.app)
  for (let i = 0; i < 200 && w.runs() === 0; i++) await sleep(5)
  const started = Date.now()
  const duplicate = await pay(w.app, 'wait=0')
  t.equal(duplicate.statusCode, 409)
  t.equal(duplicate.headers['preference-applied'], 'wait=0')
  t.ok(Date.now() - started < 1_000, `answered in ${Date.now() - started} ms, not after the route's 5 s`)
  w.finish()
  t.equal((await original).statusCode, 200)
})

t.test('wait=1 on a route that waits 5 s: 409 after about a second, saying wait=1', async (t) => {
  const w = await world(t, 5_000)
  const original = pay(w.app)
  for (let i = 0; i < 200 && w.runs() === 0; i++) await sleep(5)
  const started = Date.now()
  const duplicate = await pay(w.app, 'wait=1')
  const took = Date.now() - started
  t.equal(duplicate.statusCode, 409)
  t.equal(duplicate.headers['preference-applied'], 'wait=1')
  t.ok(took >= 950 && took < 4_000, `answered after ${took} ms`)
  w.finish()
  await original
})

t.test('wait=10 on a route that waits 1.5 s: capped, the replay when the original answers within it, saying wait=1', async (t) => {
  const w = await world(t, 1_500)
  const original = pay(w.app)
  for (let i = 0; i < 200 && w.runs() === 0; i++) await sleep(5)
  const duplicate = pay(w.app, 'wait=10')
  await sleep(200)
  w.finish()
  const [first, second] = await Promise.all([original, duplicate])
  t.equal(second.statusCode, 200)
  t.equal(second.headers['idempotent-replayed'], 'true')
  t.equal(second.body, first.body)
  t.equal(second.headers['preference-applied'], 'wait=1', 'the route\'s 1.5 s, in whole seconds')
  t.equal(first.headers['preference-applied'], undefined, 'the original asked for nothing')
  t.equal(w.runs(), 1)
  // The replay of a later retry carries no Preference-Applied of the waiter's: it is not recorded.
  const later = await pay(w.app)
  t.equal(later.headers['preference-applied'], undefined)
})

t.test('on a route that does not wait, the preference changes nothing and is not answered', async (t) => {
  const w = await world(t, 0)
  const original = pay(w.app)
  for (let i = 0; i < 200 && w.runs() === 0; i++) await sleep(5)
  const duplicate = await pay(w.app, 'wait=3')
  t.equal(duplicate.statusCode, 409)
  t.equal(duplicate.headers['preference-applied'], undefined)
  w.finish()
  await original
})
