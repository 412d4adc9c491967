import type { FastifyReply, LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import { memoryStore, RolledBackError, TransactionEndedError, type IdempotencyOptions, type IdempotencyStore, type ProblemKind, type ProfileName } from '../../lib/index.js'
import { applyProblem, buildProblemBodies } from '../../lib/http/problems.js'
import { buildApp, deferred, keyed } from '../helpers/app.js'

/*
 * `profile` chooses the shape of the plugin's error answers. 'ietf' (the default)
 * keeps the RFC 9457 bodies byte for byte; 'stripe' answers Stripe's error object with Stripe's
 * statuses and `Stripe-Should-Retry`, which is what Stripe's SDKs decide retries on. Every kind has
 * an answer in both; each is produced here over HTTP.
 */

const KINDS: readonly ProblemKind[] = [
  'key-missing', 'key-invalid', 'key-reused', 'request-in-progress', 'store-unavailable',
  'response-not-retained', 'not-committed', 'outcome-unknown', 'transaction-ended', 'key-unknown', 'body-too-deep', 'body-too-large'
]

/**
 * A memory store that fails claims of `fail-` keys, and in atomic mode rolls back the commit of
 * `commit-` keys, loses the answer to the commit of `unknown-` keys, and reports the transaction of
 * `ended-` keys ended by the handler (held).
 */
function faultyStore (t: Test): IdempotencyStore {
  const inner = memoryStore({ purgeInterval: 0 })
  t.teardown(() => inner.close())
  return {
    ...inner,
    claim: async (request) => {
      if (request.key.startsWith('fail-')) throw new Error('connection refused')
      return inner.claim(request)
    },
    // Atomic mode as the plugin sees it: the claim comes with a transaction handle, committed by complete.
    claimInTransaction: async ({ scope, key, fingerprint, leaseMs, ttlMs }) => {
      const result = await inner.claim({ scope, key, fingerprint, leaseMs, ttlMs })
      return result.outcome === 'acquired' ? { ...result, transaction: {} } : result
    },
    complete: async (lease, response, ttl) => {
      if (lease.key.startsWith('commit-')) throw new RolledBackError('the database rolled the transaction back (could not serialize access due to concurrent update)')
      if (lease.key.startsWith('unknown-')) throw new Error('Connection terminated unexpectedly')
      if (lease.key.startsWith('ended-')) throw new TransactionEndedError(true)
      return inner.complete(lease, response, ttl)
    }
  }
}

/** One answer of every kind, from one app registered with `options`. */
async function everyKind (t: Test, options: IdempotencyOptions): Promise<Record<ProblemKind, LightMyRequestResponse>> {
  const app = await buildApp(t, { plugin: { store: faultyStore(t), statusRoute: '/idempotency-keys/:key', ...options } })
  const entered = deferred()
  const release = deferred()
  app.post('/charges', async (_request, reply) => reply.code(201).send({ id: 'ch_1' }))
  app.post('/required', { config: { idempotency: { required: true } } }, async () => ({ id: 'ch_1' }))
  app.post('/big', { config: { idempotency: { maxResponseBytes: 4 } } }, async (_request, reply) => reply.code(201).send({ id: 'ch_1' }))
  app.post('/atomic', { config: { idempotency: { transaction: true } } }, async (_request, reply) => reply.code(201).send({ id: 'ch_1' }))
  app.post('/bounded', { config: { idempotency: { maxBodyDepth: 2, maxBodyNodes: 10 } } }, async (_request, reply) => reply.code(201).send({ id: 'ch_1' }))
  app.post('/slow', async () => {
    entered.resolve()
    await release.promise
    return { id: 'ch_1' }
  })
  const post = (url: string, headers: Record<string, string>, amount = 1): Promise<LightMyRequestResponse> =>
    app.inject({ method: 'POST', url, headers, payload: { amount } })

  const missing = await post('/required', { 'content-type': 'application/json' })
  const invalid = await post('/charges', { 'idempotency-key': '"unterminated', 'content-type': 'application/json' })
  await post('/charges', keyed('reused'), 1)
  const reused = await post('/charges', keyed('reused'), 2)
  const original = post('/slow', keyed('inflight'))
  await entered.promise
  const inProgress = await post('/slow', keyed('inflight'))
  release.resolve()
  await original
  const unavailable = await post('/charges', keyed('fail-1'))
  t.equal((await post('/big', keyed('big'))).statusCode, 201, 'setup: the oversized original is answered')
  const notRetained = await post('/big', keyed('big'))
  const notCommitted = await post('/atomic', keyed('commit-1'))
  const outcomeUnknown = await post('/atomic', keyed('unknown-1'))
  const transactionEnded = await post('/atomic', keyed('ended-1'))
  const unknown = await app.inject({ method: 'GET', url: '/idempotency-keys/never-used' })
  const tooDeep = await app.inject({ method: 'POST', url: '/bounded', headers: keyed('deep'), payload: { a: { b: { c: 1 } } } })
  const tooLarge = await app.inject({ method: 'POST', url: '/bounded', headers: keyed('large'), payload: { items: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] } })
  return {
    'key-missing': missing,
    'key-invalid': invalid,
    'key-reused': reused,
    'request-in-progress': inProgress,
    'store-unavailable': unavailable,
    'response-not-retained': notRetained,
    'not-committed': notCommitted,
    'outcome-unknown': outcomeUnknown,
    'transaction-ended': transactionEnded,
    'key-unknown': unknown,
    'body-too-deep': tooDeep,
    'body-too-large': tooLarge
  }
}

interface Expected {
  readonly status: number
  readonly body: string
  /** Stripe-Should-Retry, or undefined for none. */
  readonly shouldRetry?: 'true' | 'false'
}

const INVALID_DETAIL = 'The Idempotency-Key must be a Structured Field string, such as "8e03978e-40d5-43e8-bc93-6894a57f9324".'

/**
 * The 'ietf' bodies, written out: any byte of difference is a change clients would see.
 */
const IETF: Readonly<Record<ProblemKind, Expected>> = {
  'key-missing': {
    status: 400,
    body: '{"type":"tag:fastify-idempotency,2026:key-missing","title":"Idempotency-Key is missing","status":400,' +
      '"detail":"This operation is idempotent and it requires correct usage of Idempotency Key."}'
  },
  'key-invalid': {
    status: 400,
    body: '{"type":"tag:fastify-idempotency,2026:key-invalid","title":"Idempotency-Key is invalid","status":400,' +
      `"detail":${JSON.stringify(INVALID_DETAIL)}}`
  },
  'key-reused': {
    status: 422,
    body: '{"type":"tag:fastify-idempotency,2026:key-reused","title":"Idempotency-Key is already used","status":422,' +
      '"detail":"This Idempotency-Key was used with a different request (method, target or body). ' +
      'Idempotency Key MUST not be reused across different payloads of this operation."}'
  },
  'request-in-progress': {
    status: 409,
    body: '{"type":"tag:fastify-idempotency,2026:request-in-progress","title":"A request is outstanding for this Idempotency-Key",' +
      '"status":409,"detail":"A request with the same Idempotency-Key for the same operation is being processed or is outstanding. ' +
      'Retry the same request later."}'
  },
  'store-unavailable': {
    status: 503,
    body: '{"type":"tag:fastify-idempotency,2026:store-unavailable","title":"Idempotency store is unavailable","status":503,' +
      '"detail":"The request was not processed because its Idempotency-Key could not be checked. Retry the same request later."}'
  },
  'response-not-retained': {
    status: 410,
    body: '{"type":"tag:fastify-idempotency,2026:response-not-retained","title":"Idempotency-Key response was not retained",' +
      '"status":410,"detail":"The operation for this Idempotency-Key completed, but its response was too large to be recorded, ' +
      'so it cannot be replayed. The operation will not be executed again.","originalStatus":201}'
  },
  'not-committed': {
    status: 500,
    body: '{"type":"tag:fastify-idempotency,2026:not-committed","title":"Idempotent operation was not committed","status":500,' +
      '"detail":"The transaction holding this operation and its Idempotency-Key could not be committed, so nothing was recorded ' +
      'and its writes were rolled back. Retry the same request."}'
  },
  // The atomic mode's ambiguous commit.
  'outcome-unknown': {
    status: 503,
    body: '{"type":"tag:fastify-idempotency,2026:outcome-unknown","title":"Idempotent operation outcome is unknown","status":503,' +
      '"detail":"The transaction holding this operation and its Idempotency-Key was sent to be committed, but whether it ' +
      'committed could not be confirmed. Retry the same request with the same Idempotency-Key: it replays the recorded ' +
      'response if the operation committed, and runs it if it did not."}'
  },
  // The atomic handle's fail-closed end.
  'transaction-ended': {
    status: 500,
    body: '{"type":"tag:fastify-idempotency,2026:transaction-ended","title":"Idempotent operation ended its own transaction",' +
      '"status":500,"detail":"The transaction holding this operation and its Idempotency-Key was ended by the operation itself, ' +
      'before its response was recorded, so what it wrote may or may not have been kept. The key is held until the service ' +
      'reconciles it; retries with it are answered 409 until then."}'
  },
  // The status route's.
  'key-unknown': {
    status: 404,
    body: '{"type":"tag:fastify-idempotency,2026:key-unknown","title":"Idempotency-Key is unknown","status":404,' +
      '"detail":"No request with this Idempotency-Key is recorded for you: it was never used, or its record expired."}'
  },
  // The bounded canonical walk.
  'body-too-deep': {
    status: 400,
    body: '{"type":"tag:fastify-idempotency,2026:body-too-deep","title":"Request body is nested too deeply","status":400,' +
      '"detail":"The request body nests arrays and objects deeper than this operation accepts, so it was not processed.",' +
      '"maxBodyDepth":2}'
  },
  'body-too-large': {
    status: 413,
    body: '{"type":"tag:fastify-idempotency,2026:body-too-large","title":"Request body holds too many values","status":413,' +
      '"detail":"The request body holds more values than this operation accepts, so it was not processed.",' +
      '"maxBodyNodes":10}'
  }
}

/** Stripe's error objects: `{ error: { code?, message, type } }`, Stripe's statuses. */
const STRIPE: Readonly<Record<ProblemKind, Expected>> = {
  'key-missing': {
    status: 400,
    shouldRetry: 'false',
    body: '{"error":{"message":"This request requires an Idempotency-Key header.","type":"invalid_request_error"}}'
  },
  'key-invalid': {
    status: 400,
    shouldRetry: 'false',
    body: `{"error":{"message":${JSON.stringify(INVALID_DETAIL)},"type":"invalid_request_error"}}`
  },
  'key-reused': {
    status: 400,
    shouldRetry: 'false',
    body: '{"error":{"message":"Keys for idempotent requests can only be used with the same parameters they were first used with. ' +
      'Try using a key other than the one you sent if you meant to execute a different request.","type":"idempotency_error"}}'
  },
  'request-in-progress': {
    status: 409,
    shouldRetry: 'true',
    body: '{"error":{"code":"idempotency_key_in_use","message":"There is currently another in-progress request using this ' +
      'idempotency key (that probably means you submitted twice, and the other request is still going through). ' +
      'Please try again later.","type":"idempotency_error"}}'
  },
  'store-unavailable': {
    status: 503,
    shouldRetry: 'true',
    body: '{"error":{"message":"The request was not processed because its idempotency key could not be checked. ' +
      'Please try again later.","type":"api_error"}}'
  },
  'response-not-retained': {
    status: 410,
    shouldRetry: 'false',
    body: '{"error":{"message":"The operation for this idempotency key completed, but its response was too large to be recorded, ' +
      'so it cannot be replayed. The operation will not be executed again.","original_status":201,"type":"idempotency_error"}}'
  },
  'not-committed': {
    status: 500,
    shouldRetry: 'true',
    body: '{"error":{"message":"The operation for this idempotency key could not be committed, so nothing was recorded and its ' +
      'writes were rolled back. Retry the same request.","type":"api_error"}}'
  },
  'outcome-unknown': {
    status: 503,
    shouldRetry: 'true',
    body: '{"error":{"message":"The operation for this idempotency key was sent to be committed, but whether it committed ' +
      'could not be confirmed. Retry the same request with the same idempotency key.","type":"api_error"}}'
  },
  'transaction-ended': {
    status: 500,
    shouldRetry: 'true',
    body: '{"error":{"message":"The operation for this idempotency key ended its own transaction before its response was ' +
      'recorded. The key is held until the service reconciles it.","type":"api_error"}}'
  },
  'key-unknown': {
    status: 404,
    shouldRetry: 'false',
    body: '{"error":{"code":"resource_missing","message":"No such idempotency key.","type":"invalid_request_error"}}'
  },
  'body-too-deep': {
    status: 400,
    shouldRetry: 'false',
    body: '{"error":{"message":"The request body nests arrays and objects deeper than this operation accepts, so it was not ' +
      'processed.","max_body_depth":2,"type":"invalid_request_error"}}'
  },
  'body-too-large': {
    status: 413,
    shouldRetry: 'false',
    body: '{"error":{"message":"The request body holds more values than this operation accepts, so it was not processed.",' +
      '"max_body_nodes":10,"type":"invalid_request_error"}}'
  }
}

const PROFILES: ReadonlyArray<readonly [ProfileName | undefined, Readonly<Record<ProblemKind, Expected>>, RegExp]> = [
  // Fastify adds the charset to a string sent with reply.send(); not-committed replaces the body in onSend, after that.
  [undefined, IETF, /^application\/problem\+json(; charset=utf-8)?$/],
  ['ietf', IETF, /^application\/problem\+json(; charset=utf-8)?$/],
  ['stripe', STRIPE, /^application\/json(; charset=utf-8)?$/]
]

for (const [profile, expected, contentType] of PROFILES) {
  const name = profile ?? 'no profile option'
  t.test(`${name}: every kind's status, body and headers`, async (t) => {
    const answers = await everyKind(t, profile === undefined ? {} : { profile })
    for (const kind of KINDS) {
      const res = answers[kind]
      t.equal(res.statusCode, expected[kind].status, `${kind}: status`)
      t.equal(res.body, expected[kind].body, `${kind}: body, byte for byte`)
      t.match(res.headers['content-type'], contentType, `${kind}: content type`)
      t.equal(res.headers['cache-control'], 'no-store', `${kind}: never cached`)
      t.equal(res.headers['stripe-should-retry'], expected[kind].shouldRetry, `${kind}: Stripe-Should-Retry`)
      const retries = kind === 'request-in-progress' || kind === 'store-unavailable' || kind === 'outcome-unknown'
      t.equal(res.headers['retry-after'], retries ? '1' : undefined, `${kind}: Retry-After`)
    }
  })
}

t.test('stripe: every body is an error object Stripe\'s SDKs recognise as an error', async (t) => {
  const answers = await everyKind(t, { profile: 'stripe' })
  for (const kind of KINDS) {
    const body = JSON.parse(answers[kind].body) as { error?: Record<string, unknown> }
    t.same(Object.keys(body), ['error'], `${kind}: one member, error (a body without it is taken for a result)`)
    t.match(body.error, { type: /^(invalid_request_error|idempotency_error|api_error)$/, message: String }, `${kind}: type and message`)
    t.notOk(answers[kind].body.includes('tag:fastify-idempotency'), `${kind}: no RFC 9457 member`)
    const status = answers[kind].statusCode
    // Stripe's SDKs retry 409 and 5xx unless Stripe-Should-Retry says false; ours agrees with the status.
    t.equal(answers[kind].headers['stripe-should-retry'], String(status === 409 || status >= 500), `${kind}: Stripe-Should-Retry matches the SDK default`)
  }
})

t.test('stripe: docsUrl becomes doc_url in every error, and the Link header stays', async (t) => {
  const docsUrl = 'https://docs.example.com/errors/idempotency'
  const answers = await everyKind(t, { profile: 'stripe', docsUrl })
  for (const kind of KINDS) {
    const body = JSON.parse(answers[kind].body) as { error: Record<string, unknown> }
    t.equal(body.error.doc_url, docsUrl, `${kind}: doc_url`)
    t.equal(answers[kind].headers.link, `<${docsUrl}>; rel="describedby"; type="text/html"`, `${kind}: Link`)
  }
  t.equal(answers['request-in-progress'].body,
    `{"error":{"code":"idempotency_key_in_use","doc_url":${JSON.stringify(docsUrl)},"message":"There is currently another in-progress ` +
    'request using this idempotency key (that probably means you submitted twice, and the other request is still going through). ' +
    'Please try again later.","type":"idempotency_error"}}', 'members in Stripe\'s order: code, doc_url, message, type')
})

t.test('stripe: replays keep Idempotent-Replayed and are never reshaped', async (t) => {
  const app = await buildApp(t, { plugin: { profile: 'stripe' } })
  let runs = 0
  app.post('/charges', async (_request, reply) => { runs++; return reply.code(402).send({ error: { type: 'card_error', code: 'card_declined' } }) })
  const first = await app.inject({ method: 'POST', url: '/charges', headers: keyed('k'), payload: {} })
  const again = await app.inject({ method: 'POST', url: '/charges', headers: keyed('k'), payload: {} })
  t.equal(again.statusCode, 402)
  t.equal(again.body, first.body)
  t.equal(again.headers['idempotent-replayed'], 'true')
  t.equal(again.headers['stripe-should-retry'], undefined, 'the handler\'s own answer carries no header of ours')
  t.equal(runs, 1)
})

t.test('problem bodies are built once per registration: an answer without occurrence detail is the pre-built string', async (t) => {
  for (const profile of ['ietf', 'stripe'] as const) {
    const bodies = buildProblemBodies({ typeBase: 'tag:x,2026:', docsUrl: null, profile })
    t.ok(Object.isFrozen(bodies), `${profile}: frozen`)
    t.same(Object.keys(bodies).sort(), [...KINDS].sort(), `${profile}: one answer per kind`)
    const headers = new Map<string, string>()
    let status = 0
    const reply = {
      code (code: number) { status = code; return this },
      header (name: string, value: string) { headers.set(name, value); return this }
    } as unknown as FastifyReply
    for (const kind of KINDS) {
      const body = applyProblem(reply, bodies, { typeBase: 'tag:x,2026:', docsUrl: null, profile }, { kind })
      t.equal(body, bodies[kind].body, `${profile} ${kind}: the same string`)
      t.equal(status, bodies[kind].status, `${profile} ${kind}: its status`)
      t.doesNotThrow(() => JSON.parse(body), `${profile} ${kind}: valid JSON`)
    }
  }
})

t.test('profile is validated at registration, and is not a route option', async (t) => {
  for (const bad of ['Stripe', 'rfc9457', '', 1, null, ['stripe']]) {
    await t.rejects(async () => { await buildApp(t, { plugin: { profile: bad as ProfileName } }) },
      { name: 'InvalidOptionError', code: 'FST_IDEMPOTENCY_INVALID_OPTION', option: 'option "profile"' }, `${JSON.stringify(bad)} is refused`)
  }
  const app = await buildApp(t)
  t.throws(() => app.post('/x', { config: { idempotency: { profile: 'stripe' } as never } }, async () => ({})),
    { code: 'FST_IDEMPOTENCY_INVALID_OPTION', option: 'route POST /x config.idempotency.profile' })
})
