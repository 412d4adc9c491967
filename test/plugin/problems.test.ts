import type { FastifyInstance, LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import { memoryStore, type IdempotencyOptions, type IdempotencyStore, type ProblemKind } from '../../lib/index.js'
import { buildApp, deferred, keyed, PROBLEM_TYPE } from '../helpers/app.js'

/*
 * Behaviour 7: the plugin's own answers are RFC 9457 problem documents, one absolute `type` per
 * kind, a constant `title` (the draft's where it has one), `status` equal to the HTTP status, a
 * `detail`; they never leak the key, a stack trace or a recorded response, and are never recorded.
 */

/** Every kind a memory-store app can produce; the atomic mode's kinds are tested with the Postgres driver (and test/plugin/profiles.test.ts). */
type MemoryKind = Exclude<ProblemKind, 'not-committed' | 'outcome-unknown' | 'transaction-ended'>

const KINDS: readonly MemoryKind[] = [
  'key-missing', 'key-invalid', 'key-reused', 'request-in-progress', 'store-unavailable', 'response-not-retained', 'key-unknown',
  'body-too-deep', 'body-too-large'
]

const STATUS: Readonly<Record<MemoryKind, number>> = {
  'key-missing': 400,
  'key-invalid': 400,
  'key-reused': 422,
  'request-in-progress': 409,
  'store-unavailable': 503,
  'response-not-retained': 410,
  'key-unknown': 404,
  'body-too-deep': 400,
  'body-too-large': 413
}

/** The draft's titles (§2.7), verbatim. */
const DRAFT_TITLES: Partial<Readonly<Record<ProblemKind, string>>> = {
  'key-missing': 'Idempotency-Key is missing',
  'key-reused': 'Idempotency-Key is already used',
  'request-in-progress': 'A request is outstanding for this Idempotency-Key'
}

/** Distinctive values that must never show up in a problem body. */
const SECRET = 'RECORDED-SECRET'
const KEY = (kind: string): string => `kv-${kind}-7f3a9c`

interface World {
  readonly app: FastifyInstance
  readonly store: IdempotencyStore
  readonly runs: () => number
  /** One response of each kind, produced on one app. */
  readonly problems: Record<MemoryKind, LightMyRequestResponse>
}

/**
 * A store that fails every claim for keys starting with `fail-` (as a broken database would) and
 * behaves like the memory store for every other key.
 */
function failingStore (inner: IdempotencyStore, failures = Infinity): IdempotencyStore {
  let failed = 0
  return {
    ...inner,
    claim: async (request) => {
      if (request.key.startsWith('fail-') && failed < failures) {
        failed++
        throw new Error(`connection refused /srv/db.sock (${SECRET})`)
      }
      return inner.claim(request)
    }
  }
}

async function world (t: Test, plugin: IdempotencyOptions = {}): Promise<World> {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  const store = failingStore(inner)
  const app = await buildApp(t, { plugin: { store, statusRoute: '/idempotency-keys/:key', ...plugin } })
  let runs = 0
  const entered = deferred()
  const release = deferred()
  const charge = (): { id: string, secret: string } => {
    runs++
    return { id: `ch_${runs}`, secret: `${SECRET}-${runs}` }
  }
  app.post('/charges', async (_request, reply) => { reply.code(201); return charge() })
  app.post('/required', { config: { idempotency: { required: true } } }, async (_request, reply) => { reply.code(201); return charge() })
  app.post('/big', { config: { idempotency: { maxResponseBytes: 4 } } }, async (_request, reply) => { reply.code(201); return charge() })
  app.post('/bounded', { config: { idempotency: { maxBodyDepth: 2, maxBodyNodes: 10 } } }, async (_request, reply) => { reply.code(201); return charge() })
  app.post('/slow', async (_request, reply) => {
    const body = charge()
    entered.resolve()
    await release.promise
    reply.code(201)
    return body
  })
  const post = (url: string, headers: Record<string, string>, payload: unknown = { amount: 100 }): Promise<LightMyRequestResponse> =>
    app.inject({ method: 'POST', url, headers, payload: payload as Record<string, unknown> })

  // A completed key with a recorded body, whose data no problem may ever show.
  const other = await post('/charges', keyed(KEY('other')))
  t.equal(other.statusCode, 201, 'setup: another key completed')

  const missing = await post('/required', { 'content-type': 'application/json' })
  const invalid = await post('/charges', { 'idempotency-key': `"${KEY('invalid')}`, 'content-type': 'application/json' })

  await post('/charges', keyed(KEY('reused')), { amount: 100 })
  const reused = await post('/charges', keyed(KEY('reused')), { amount: 999 })

  const original = post('/slow', keyed(KEY('inflight')))
  await entered.promise
  const inProgress = await post('/slow', keyed(KEY('inflight')))
  release.resolve()
  t.equal((await original).statusCode, 201, 'setup: the in-flight original completed')

  const unavailable = await post('/charges', keyed(`fail-${KEY('store')}`))

  const big = await post('/big', keyed(KEY('big')))
  t.equal(big.statusCode, 201, 'setup: the oversized original is answered in full')
  const notRetained = await post('/big', keyed(KEY('big')))

  const unknown = await app.inject({ method: 'GET', url: `/idempotency-keys/${KEY('unknown')}` })

  const tooDeep = await post('/bounded', keyed(KEY('deep')), { a: { b: { c: 1 } } })
  const tooLarge = await post('/bounded', keyed(KEY('large')), { items: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] })

  return {
    app,
    store,
    runs: () => runs,
    problems: {
      'key-missing': missing,
      'key-invalid': invalid,
      'key-reused': reused,
      'request-in-progress': inProgress,
      'store-unavailable': unavailable,
      'response-not-retained': notRetained,
      'key-unknown': unknown,
      'body-too-deep': tooDeep,
      'body-too-large': tooLarge
    }
  }
}

function problemOf (res: LightMyRequestResponse): Record<string, unknown> {
  const parsed: unknown = JSON.parse(res.body)
  if (parsed === null || typeof parsed !== 'object' || Array.isArray(parsed)) throw new Error(`not a JSON object: ${res.body}`)
  return parsed as Record<string, unknown>
}

t.test('every plugin answer has the status of its kind', async (t) => {
  const w = await world(t)
  for (const kind of KINDS) t.equal(w.problems[kind].statusCode, STATUS[kind], `${kind} is ${STATUS[kind]}`)
})

t.test('every plugin answer is application/problem+json (a charset parameter is allowed)', async (t) => {
  const w = await world(t)
  for (const kind of KINDS) {
    t.match(w.problems[kind].headers['content-type'], /^application\/problem\+json\s*(;\s*charset=utf-8\s*)?$/i, kind)
  }
})

t.test('every problem body parses to a JSON object with type, title, status and detail', async (t) => {
  const w = await world(t)
  for (const kind of KINDS) {
    const res = w.problems[kind]
    const problem = problemOf(res)
    t.type(problem.type, 'string', `${kind}: type`)
    t.type(problem.title, 'string', `${kind}: title`)
    t.equal(problem.status, res.statusCode, `${kind}: status equals the HTTP status`)
    t.type(problem.detail, 'string', `${kind}: detail`)
    t.ok(String(problem.detail).length > 0, `${kind}: detail is not empty`)
  }
})

t.test('every kind has its own absolute type URI', async (t) => {
  const w = await world(t)
  const types = new Set<string>()
  for (const kind of KINDS) {
    const type = problemOf(w.problems[kind]).type
    t.equal(type, PROBLEM_TYPE(kind), `${kind}: type`)
    t.match(type, /^[a-zA-Z][a-zA-Z0-9+.-]*:\S+$/, `${kind}: an absolute URI (RFC 3986 §4.3)`)
    types.add(String(type))
  }
  t.equal(types.size, KINDS.length, `${KINDS.length} kinds, ${KINDS.length} types`)
})

t.test('the draft\'s three titles are used verbatim', async (t) => {
  const w = await world(t)
  for (const [kind, title] of Object.entries(DRAFT_TITLES)) {
    t.equal(problemOf(w.problems[kind as MemoryKind]).title, title, kind)
  }
})

t.test('titles are constant per kind, whatever the occurrence', async (t) => {
  const w = await world(t)
  const app = w.app
  const empty = await app.inject({ method: 'POST', url: '/charges', headers: { 'idempotency-key': '""' }, payload: {} })
  const tooLong = await app.inject({ method: 'POST', url: '/charges', headers: { 'idempotency-key': `"${'k'.repeat(256)}"` }, payload: {} })
  const list = await app.inject({ method: 'POST', url: '/charges', headers: { 'idempotency-key': '"a", "b"' }, payload: {} })
  const titles = [w.problems['key-invalid'], empty, tooLong, list].map((r) => problemOf(r).title)
  t.same(new Set(titles).size, 1, `one title for every invalid key: ${JSON.stringify(titles)}`)
  for (const r of [empty, tooLong, list]) t.equal(problemOf(r).type, PROBLEM_TYPE('key-invalid'))

  const reusedAgain = await app.inject({ method: 'POST', url: '/charges', headers: keyed(KEY('reused')), payload: { amount: 5 } })
  t.equal(problemOf(reusedAgain).title, problemOf(w.problems['key-reused']).title)
})

t.test('titles of different kinds differ', async (t) => {
  const w = await world(t)
  const titles = new Set(KINDS.map((kind) => problemOf(w.problems[kind]).title))
  t.equal(titles.size, KINDS.length)
})

t.test('409 and 503 carry Retry-After: 1 by default; the other problems do not', async (t) => {
  const w = await world(t)
  t.equal(w.problems['request-in-progress'].headers['retry-after'], '1')
  t.equal(w.problems['store-unavailable'].headers['retry-after'], '1')
  for (const kind of ['key-missing', 'key-invalid', 'key-reused', 'response-not-retained', 'key-unknown'] as const) {
    t.equal(w.problems[kind].headers['retry-after'], undefined, `${kind}: retrying the same request cannot help`)
  }
})

t.test('the retryAfter option sets the Retry-After of 409 and 503', async (t) => {
  const w = await world(t, { retryAfter: 7 })
  t.equal(w.problems['request-in-progress'].headers['retry-after'], '7')
  t.equal(w.problems['store-unavailable'].headers['retry-after'], '7')
})

t.test('docsUrl adds Link: <url>; rel="describedby"; type="text/html" to every problem', async (t) => {
  const url = 'https://docs.example.com/idempotency'
  const w = await world(t, { docsUrl: url })
  for (const kind of KINDS) {
    t.equal(w.problems[kind].headers.link, `<${url}>; rel="describedby"; type="text/html"`, kind)
  }
})

t.test('without docsUrl, problems carry no Link header', async (t) => {
  const w = await world(t)
  for (const kind of KINDS) t.equal(w.problems[kind].headers.link, undefined, kind)
})

t.test('problemTypeBase changes the prefix of every type', async (t) => {
  const base = 'https://errors.example.com/idempotency/'
  const w = await world(t, { problemTypeBase: base })
  for (const kind of KINDS) t.equal(problemOf(w.problems[kind]).type, `${base}${kind}`, kind)
})

t.test('no problem body contains the key, a stack trace or a recorded response', async (t) => {
  const w = await world(t)
  for (const kind of KINDS) {
    const body = w.problems[kind].body
    t.notOk(body.includes('kv-'), `${kind}: no key value`)
    t.notOk(body.includes('7f3a9c'), `${kind}: no part of the key`)
    t.notOk(body.includes(SECRET), `${kind}: no recorded body and no store error text`)
    t.notOk(body.includes('ch_'), `${kind}: no recorded body`)
    t.notMatch(body, /\bat \S+ \(|\.ts:\d+|\.js:\d+|node:internal|Error:/, `${kind}: no stack trace`)
    t.notOk(body.includes('/srv/db.sock'), `${kind}: no store error message`)
  }
})

t.test('a 409 is never recorded: once the original completes, the same request replays the original 201', async (t) => {
  const app = await buildApp(t)
  let runs = 0
  const entered = deferred()
  const release = deferred()
  app.post('/slow', async (_request, reply) => {
    runs++
    entered.resolve()
    await release.promise
    reply.code(201)
    return { id: `ch_${runs}` }
  })
  const send = (): Promise<LightMyRequestResponse> => app.inject({ method: 'POST', url: '/slow', headers: keyed('k409'), payload: { amount: 1 } })

  // Truly simultaneous: both are in flight before either is answered.
  const both = [send(), send()]
  await entered.promise
  const conflict = await Promise.race(both)
  t.equal(conflict.statusCode, 409, 'the duplicate is answered while the original is held')
  release.resolve()
  const [a, b] = await Promise.all(both)
  const original = a?.statusCode === 201 ? a : b
  t.equal(original?.statusCode, 201)
  t.same([a?.statusCode, b?.statusCode].sort(), [201, 409])

  const retry = await send()
  t.equal(retry.statusCode, 201, 'the retry replays the original, not the 409')
  t.equal(retry.headers['idempotent-replayed'], 'true')
  t.equal(retry.body, original?.body)
  t.equal(runs, 1)
})

t.test('a 422 never overwrites the record: the original request still replays the original', async (t) => {
  const w = await world(t)
  const again = await w.app.inject({ method: 'POST', url: '/charges', headers: keyed(KEY('reused')), payload: { amount: 100 } })
  t.equal(again.statusCode, 201)
  t.equal(again.headers['idempotent-replayed'], 'true')
  t.match(again.json(), { id: String })
  const record = await w.store.get({ scope: 'test', key: KEY('reused') })
  t.equal(record?.state, 'completed')
  if (record?.state === 'completed') {
    t.equal(record.response.statusCode, 201)
    t.equal(record.response.body?.toString(), again.body, 'the record holds the original body')
  }
  const mismatch = await w.app.inject({ method: 'POST', url: '/charges', headers: keyed(KEY('reused')), payload: { amount: 999 } })
  t.equal(mismatch.statusCode, 422, 'the different request is still refused')
})

t.test('a 503 is never recorded: when the store recovers, the same request executes', async (t) => {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  const app = await buildApp(t, { plugin: { store: failingStore(inner, 1) } })
  let runs = 0
  app.post('/charges', async (_request, reply) => { runs++; reply.code(201); return { id: `ch_${runs}` } })
  const send = (): Promise<LightMyRequestResponse> => app.inject({ method: 'POST', url: '/charges', headers: keyed('fail-once'), payload: { amount: 1 } })

  const down = await send()
  t.equal(down.statusCode, 503)
  t.equal(runs, 0, 'never a silent unprotected run')
  t.equal(await inner.get({ scope: 'test', key: 'fail-once' }), null, 'nothing recorded')

  const retry = await send()
  t.equal(retry.statusCode, 201, 'the retry executes')
  t.equal(runs, 1)
  const replay = await send()
  t.equal(replay.statusCode, 201)
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal(runs, 1)
})

t.test('a 410 is never recorded and never re-executes: every retry gets 410 again', async (t) => {
  const w = await world(t)
  const before = w.runs()
  const again = await w.app.inject({ method: 'POST', url: '/big', headers: keyed(KEY('big')), payload: { amount: 100 } })
  t.equal(again.statusCode, 410)
  t.equal(problemOf(again).type, PROBLEM_TYPE('response-not-retained'))
  t.equal(w.runs(), before, 'the handler did not run again')
  const record = await w.store.get({ scope: 'test', key: KEY('big') })
  t.match(record, { state: 'completed', response: { statusCode: 201, body: null } }, 'the record still says: completed, not retained')
})

t.test('400 answers store nothing: a corrected retry executes', async (t) => {
  const app = await buildApp(t, { plugin: { required: true } })
  let runs = 0
  app.post('/charges', async (_request, reply) => { runs++; reply.code(201); return { id: `ch_${runs}` } })
  const missing = await app.inject({ method: 'POST', url: '/charges', payload: {} })
  t.equal(missing.statusCode, 400)
  const invalid = await app.inject({ method: 'POST', url: '/charges', headers: { 'idempotency-key': '"k-400' }, payload: {} })
  t.equal(invalid.statusCode, 400)
  t.equal(runs, 0)
  const corrected = await app.inject({ method: 'POST', url: '/charges', headers: keyed('k-400'), payload: {} })
  t.equal(corrected.statusCode, 201)
  t.equal(corrected.headers['idempotent-replayed'], undefined)
  t.equal(runs, 1)
})
