import net from 'node:net'
import type { FastifyInstance, InjectOptions, LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import { memoryStore, type IdempotencyContext, type IdempotencyOptions, type IdempotencyStore } from '../../lib/index.js'
import { parseKey } from '../../lib/http/key.js'
import { buildApp, PROBLEM_TYPE } from '../helpers/app.js'

/*
 * Behaviour 1 (key parsing) and 2 (missing header). The key is the draft's Item Structured Field
 * whose value is an sf-string (RFC 9651 §3.3.3); lenient mode (the default) also takes a bare value.
 */

const UUID = '8e03978e-40d5-43e8-bc93-6894a57f9324'
const ONE_LINE = ['Idempotency-Key', 'x']

/** A value as a short, ASCII-only label for assertion messages (TAP lines must not break). */
function show (value: unknown): string {
  const text = (JSON.stringify(value) ?? String(value)).replace(/[^\x20-\x7e]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`)
  return text.length > 40 ? `${text.slice(0, 30)}…(${text.length} chars)` : text
}

// ---------------------------------------------------------------------------------------------
// parseKey, unit level
// ---------------------------------------------------------------------------------------------

t.test('parseKey', async (t) => {
  const ok = (t: Test, value: string | string[] | undefined, key: string, format: 'strict' | 'lenient' = 'strict', max = 255, raw = ONE_LINE): void => {
    t.same(parseKey(value, raw, format, max), { ok: true, key }, `${show(value)} (${format}) is the key ${show(key)}`)
  }
  const bad = (t: Test, value: string | string[] | undefined, format: 'strict' | 'lenient' = 'strict', max = 255, raw = ONE_LINE): void => {
    const parsed = parseKey(value, raw, format, max)
    t.match(parsed, { ok: false, reason: 'invalid', detail: String }, `${show(value)} (${format}) is invalid`)
  }

  t.test('an sf-string is the characters between the quotes', async (t) => {
    ok(t, '"abc"', 'abc')
    ok(t, `"${UUID}"`, UUID)
    ok(t, '"a b c"', 'a b c', 'strict')
    ok(t, '"abc"', 'abc', 'lenient')
  })

  t.test('the escapes \\" and \\\\ are decoded', async (t) => {
    ok(t, '"a\\"b"', 'a"b')
    ok(t, '"a\\\\b"', 'a\\b')
    ok(t, '"\\"\\\\"', '"\\')
    ok(t, '"a\\"b"', 'a"b', 'lenient')
  })

  t.test('any other escape is malformed', async (t) => {
    bad(t, '"a\\nb"')
    bad(t, '"a\\nb"', 'lenient')
    bad(t, '"a\\tb"')
    bad(t, '"abc\\"')
  })

  t.test('parameters are ignored', async (t) => {
    ok(t, '"abc";p=1', 'abc')
    ok(t, '"abc";p=1;q="x";r', 'abc')
    ok(t, '"abc";p=1', 'abc', 'lenient')
  })

  t.test('surrounding spaces are ignored', async (t) => {
    ok(t, ' "abc" ', 'abc')
    ok(t, '   "abc"', 'abc', 'lenient')
    ok(t, ' "abc" ', 'abc', 'lenient')
  })

  t.test('a missing header is reported as missing, not invalid', async (t) => {
    t.match(parseKey(undefined, [], 'strict', 255), { ok: false, reason: 'missing' })
    t.match(parseKey(undefined, [], 'lenient', 255), { ok: false, reason: 'missing' })
  })

  t.test('an empty sf-string and an empty field value are invalid', async (t) => {
    bad(t, '""')
    bad(t, '""', 'lenient')
    bad(t, '')
    bad(t, '', 'lenient')
    bad(t, '   ', 'lenient')
  })

  t.test('non-ASCII is invalid', async (t) => {
    bad(t, '"é"')
    bad(t, '"é"', 'lenient')
    bad(t, '"\u00e9"')
    bad(t, '"\u00c3\u00a9"', 'lenient') // UTF-8 é as Node decodes header bytes (latin1)
    bad(t, 'é', 'lenient')
    bad(t, '"a\u2028b"')
  })

  t.test('a list is invalid', async (t) => {
    bad(t, '"a", "b"')
    bad(t, '"a", "b"', 'lenient')
    bad(t, '"a","b"', 'lenient')
  })

  t.test('two field lines are invalid, even when their join would parse', async (t) => {
    bad(t, ['"abc"', '"def"'])
    bad(t, ['"abc"', '"def"'], 'lenient')
    const twoLines = ['Idempotency-Key', '"foo', 'idempotency-key', 'bar"']
    bad(t, '"foo, bar"', 'strict', 255, twoLines)
    bad(t, '"foo, bar"', 'lenient', 255, twoLines)
  })

  t.test('a comma inside one sf-string on one field line is part of the key', async (t) => {
    ok(t, '"foo, bar"', 'foo, bar', 'strict', 255, ['Idempotency-Key', '"foo, bar"'])
    ok(t, '"foo, bar"', 'foo, bar', 'lenient', 255, ['Idempotency-Key', '"foo, bar"'])
  })

  t.test('malformed sf-strings are invalid', async (t) => {
    for (const format of ['strict', 'lenient'] as const) {
      bad(t, '"abc', format)
      bad(t, 'abc"', format)
      bad(t, '"abc"x', format)
      bad(t, '"abc" "def"', format)
      bad(t, '"a\tb"', format)
    }
  })

  t.test('single quotes are quotes too: \'abc\' is invalid in both modes', async (t) => {
    bad(t, "'abc'", 'strict')
    bad(t, "'abc'", 'lenient')
    bad(t, "it's", 'lenient')
  })

  t.test('strict mode accepts only an sf-string', async (t) => {
    bad(t, 'abc') // token
    bad(t, '123') // integer
    bad(t, '1.5') // decimal
    bad(t, '%"abc"') // display string
    bad(t, '?1') // boolean
    bad(t, ':YWJj:') // byte sequence
    bad(t, UUID)
  })

  t.test('lenient mode accepts a bare value of visible ASCII', async (t) => {
    ok(t, UUID, UUID, 'lenient')
    ok(t, `stripe-node-retry-${UUID}`, `stripe-node-retry-${UUID}`, 'lenient')
    ok(t, 'abc', 'abc', 'lenient')
    ok(t, '123', '123', 'lenient')
    ok(t, '?1', '?1', 'lenient')
  })

  t.test('lenient mode rejects bare values with whitespace, quotes or commas', async (t) => {
    bad(t, 'a b', 'lenient')
    bad(t, 'a\tb', 'lenient')
    bad(t, 'ab"c', 'lenient')
    bad(t, '%"abc"', 'lenient')
    bad(t, 'a,b', 'lenient')
  })

  t.test('the length limit counts the key, not its quotes', async (t) => {
    ok(t, `"${'a'.repeat(255)}"`, 'a'.repeat(255))
    bad(t, `"${'a'.repeat(256)}"`)
    ok(t, 'a'.repeat(255), 'a'.repeat(255), 'lenient')
    bad(t, 'a'.repeat(256), 'lenient')
    ok(t, `"${'a'.repeat(300)}"`, 'a'.repeat(300), 'strict', 1024)
    bad(t, `"${'a\\"'.repeat(128)}"`, 'strict', 255) // 256 characters once unescaped
    ok(t, `"${'a\\"'.repeat(127)}a"`, 'a"'.repeat(127) + 'a', 'strict', 255) // 255 once unescaped
  })
})

// ---------------------------------------------------------------------------------------------
// Through HTTP
// ---------------------------------------------------------------------------------------------

interface Harness {
  readonly app: FastifyInstance
  readonly store: IdempotencyStore
  /** Handler executions. */
  readonly runs: () => number
  /** request.idempotency of every request that reached onResponse, in order. */
  readonly seen: Array<IdempotencyContext | null>
  /** Calls to store.claim: a request refused before the store never touches it. */
  readonly claims: () => number
  readonly post: (key?: string | string[], extra?: Partial<InjectOptions>) => Promise<LightMyRequestResponse>
}

async function harness (t: Test, plugin: IdempotencyOptions = {}): Promise<Harness> {
  const inner = memoryStore({ purgeInterval: 0 })
  let claims = 0
  const store: IdempotencyStore = {
    ...inner,
    claim: (request) => { claims++; return inner.claim(request) }
  }
  const app = await buildApp(t, { plugin: { store, ...plugin } })
  t.teardown(() => inner.close())
  let runs = 0
  const seen: Array<IdempotencyContext | null> = []
  app.addHook('onResponse', async (request) => {
    seen.push(request.idempotency === null ? null : { ...request.idempotency })
  })
  app.post('/charges', async (request, reply) => {
    runs++
    reply.code(201)
    return { charge: runs, key: request.idempotency?.key ?? null }
  })
  const post = (key?: string | string[], extra: Partial<InjectOptions> = {}): Promise<LightMyRequestResponse> => {
    const headers: Record<string, string | string[]> = { 'content-type': 'application/json' }
    if (key !== undefined) headers['idempotency-key'] = key
    return app.inject({ method: 'POST', url: '/charges', headers, payload: { amount: 100 }, ...extra })
  }
  return { app, store, runs: () => runs, seen, claims: () => claims, post }
}

function assertInvalid (t: Test, res: LightMyRequestResponse | RawResponse, message: string): void {
  t.equal(res.statusCode, 400, `${message}: 400`)
  t.match(res.headers['content-type'], /^application\/problem\+json(;|$)/, `${message}: a problem document`)
  const body = JSON.parse(typeof res.body === 'string' ? res.body : '') as Record<string, unknown>
  t.equal(body.type, PROBLEM_TYPE('key-invalid'), `${message}: type key-invalid`)
  t.equal(body.status, 400)
}

t.test('a quoted key is accepted, executed once and replayed', async (t) => {
  const h = await harness(t)
  const first = await h.post('"abc"')
  t.equal(first.statusCode, 201)
  t.same(first.json(), { charge: 1, key: 'abc' })
  t.equal(first.headers['idempotent-replayed'], undefined)
  const again = await h.post('"abc"')
  t.equal(again.statusCode, 201)
  t.equal(again.headers['idempotent-replayed'], 'true')
  t.equal(again.body, first.body)
  t.equal(h.runs(), 1)
  t.match(await h.store.get({ scope: 'test', key: 'abc' }), { state: 'completed' })
})

t.test('escaped keys a"b and a\\b are decoded, and distinct from each other and from ab', async (t) => {
  const h = await harness(t)
  const quote = await h.post('"a\\"b"')
  const backslash = await h.post('"a\\\\b"')
  const plain = await h.post('"ab"')
  t.same([quote.statusCode, backslash.statusCode, plain.statusCode], [201, 201, 201])
  t.same(quote.json(), { charge: 1, key: 'a"b' })
  t.same(backslash.json(), { charge: 2, key: 'a\\b' })
  t.same(plain.json(), { charge: 3, key: 'ab' })
  t.equal(h.runs(), 3, 'three keys, three executions')
  t.same(h.seen.map((c) => c?.key), ['a"b', 'a\\b', 'ab'])

  const quoteAgain = await h.post('"a\\"b"')
  const backslashAgain = await h.post('"a\\\\b"')
  t.equal(h.runs(), 3, 'retries of the escaped keys do not execute')
  t.equal(quoteAgain.headers['idempotent-replayed'], 'true')
  t.equal(quoteAgain.body, quote.body, 'a"b replays its own response')
  t.equal(backslashAgain.headers['idempotent-replayed'], 'true')
  t.equal(backslashAgain.body, backslash.body, 'a\\b replays its own response')
  t.match(h.seen[3], { key: 'a"b', replayed: true })
  t.match(h.seen[4], { key: 'a\\b', replayed: true })
  t.match(await h.store.get({ scope: 'test', key: 'a"b' }), { state: 'completed' })
  t.match(await h.store.get({ scope: 'test', key: 'a\\b' }), { state: 'completed' })
})

t.test('parameters are ignored: "abc";p=1 and "abc" are the same key', async (t) => {
  const h = await harness(t)
  const first = await h.post('"abc";p=1')
  t.equal(first.statusCode, 201)
  t.same(first.json(), { charge: 1, key: 'abc' })
  const second = await h.post('"abc"')
  t.equal(second.headers['idempotent-replayed'], 'true')
  t.equal(second.body, first.body)
  const third = await h.post('"abc";q=?0')
  t.equal(third.headers['idempotent-replayed'], 'true')
  t.equal(h.runs(), 1)
})

t.test('surrounding spaces are ignored: \' "abc" \' and \'"abc"\' are the same key', async (t) => {
  const h = await harness(t)
  const first = await h.post(' "abc" ')
  t.equal(first.statusCode, 201)
  t.same(first.json(), { charge: 1, key: 'abc' })
  const second = await h.post('"abc"')
  t.equal(second.headers['idempotent-replayed'], 'true')
  t.equal(h.runs(), 1)
})

const INVALID: ReadonlyArray<readonly [string, string | string[]]> = [
  ['an empty sf-string', '""'],
  ['an empty field value', ''],
  ['a non-ASCII key', '"é"'],
  ['a latin1 non-ASCII key', '"\u00e9"'],
  ['a non-ASCII bare key', 'clé'],
  ['a list', '"a", "b"'],
  ['two header lines', ['"abc"', '"def"']],
  ['two identical header lines', ['"abc"', '"abc"']],
  ['an escape other than \\" and \\\\', '"a\\nb"'],
  ['an unterminated sf-string', '"abc'],
  ['single quotes', "'abc'"],
  ['a key over maxKeyLength (256 characters)', `"${'k'.repeat(256)}"`],
  ['a bare key over maxKeyLength', 'k'.repeat(256)],
  ['a bare value with a space', 'a b'],
  ['a bare value with a double quote', 'ab"c'],
  ['a bare value with a comma', 'a,b'],
  ['a display string', '%"abc"']
]

for (const [what, value] of INVALID) {
  t.test(`${what} (${show(value)}) is refused with a 400 key-invalid problem before the handler`, async (t) => {
    const h = await harness(t)
    const res = await h.post(value)
    assertInvalid(t, res, what)
    t.equal(h.runs(), 0, 'the handler did not run')
    t.equal(h.claims(), 0, 'the store was not consulted')
    const again = await h.post(value)
    assertInvalid(t, again, `${what}, repeated`)
    t.equal(h.runs(), 0, 'a repeated invalid request still does not run')
  })
}

t.test('strict mode refuses every Structured Field type other than a string', async (t) => {
  const cases: ReadonlyArray<readonly [string, string]> = [
    ['a token', 'abc'],
    ['an integer', '123'],
    ['a display string', '%"abc"'],
    ['a boolean', '?1'],
    ['a byte sequence', ':YWJj:'],
    ['a bare UUID', UUID]
  ]
  for (const [what, value] of cases) {
    t.test(`${what} (${value}) is 400`, async (t) => {
      const h = await harness(t, { keyFormat: 'strict' })
      assertInvalid(t, await h.post(value), what)
      t.equal(h.runs(), 0)
    })
  }
  t.test('while a quoted key is accepted', async (t) => {
    const h = await harness(t, { keyFormat: 'strict' })
    const res = await h.post(`"${UUID}"`)
    t.equal(res.statusCode, 201)
    t.same(res.json(), { charge: 1, key: UUID })
  })
})

t.test('maxKeyLength: 255 characters pass by default, 256 do not', async (t) => {
  const h = await harness(t)
  const res = await h.post(`"${'k'.repeat(255)}"`)
  t.equal(res.statusCode, 201)
  t.equal(h.seen[0]?.key, 'k'.repeat(255))
  assertInvalid(t, await h.post(`"${'k'.repeat(256)}"`), '256 characters')
  t.equal(h.runs(), 1)
})

t.test('maxKeyLength 1024 lets a 300-character key through', async (t) => {
  const h = await harness(t, { maxKeyLength: 1024 })
  const key = 'k'.repeat(300)
  const first = await h.post(`"${key}"`)
  t.equal(first.statusCode, 201)
  t.equal(h.seen[0]?.key, key)
  const again = await h.post(`"${key}"`)
  t.equal(again.headers['idempotent-replayed'], 'true')
  t.equal(h.runs(), 1)
  assertInvalid(t, await h.post(`"${'k'.repeat(1025)}"`), '1025 characters')
})

t.test('lenient mode (the default) accepts a bare UUID', async (t) => {
  const h = await harness(t)
  const res = await h.post(UUID)
  t.equal(res.statusCode, 201)
  t.same(res.json(), { charge: 1, key: UUID })
  const again = await h.post(UUID)
  t.equal(again.headers['idempotent-replayed'], 'true')
  t.equal(h.runs(), 1)
})

t.test('lenient mode accepts Stripe\'s stripe-node-retry-<uuid>', async (t) => {
  const h = await harness(t)
  const key = `stripe-node-retry-${UUID}`
  const res = await h.post(key)
  t.equal(res.statusCode, 201)
  t.same(res.json(), { charge: 1, key })
})

t.test('a bare key and the quoted form of the same key are one key', async (t) => {
  const h = await harness(t)
  const bare = await h.post(UUID)
  t.equal(bare.statusCode, 201)
  const quoted = await h.post(`"${UUID}"`)
  t.equal(quoted.headers['idempotent-replayed'], 'true', 'the quoted retry replays the bare original')
  t.equal(quoted.body, bare.body)
  t.equal(h.runs(), 1)

  const h2 = await harness(t)
  await h2.post('"k-2"')
  const bareRetry = await h2.post('k-2')
  t.equal(bareRetry.headers['idempotent-replayed'], 'true', 'and the other way round')
  t.equal(h2.runs(), 1)
})

t.test('strict mode refuses a bare value with 400', async (t) => {
  const h = await harness(t, { keyFormat: 'strict' })
  assertInvalid(t, await h.post(UUID), 'bare UUID')
  assertInvalid(t, await h.post(`stripe-node-retry-${UUID}`), 'bare Stripe key')
  t.equal(h.runs(), 0)
})

t.test('without the header, a route that does not require it runs unprotected every time', async (t) => {
  const h = await harness(t)
  const responses = [await h.post(), await h.post(), await h.post()]
  t.same(responses.map((r) => r.statusCode), [201, 201, 201])
  t.same(responses.map((r) => r.json<{ charge: number }>().charge), [1, 2, 3], 'the handler ran every time')
  for (const r of responses) t.equal(r.headers['idempotent-replayed'], undefined, 'no replay header')
  t.same(h.seen, [null, null, null], 'request.idempotency is null')
  t.equal(h.claims(), 0, 'the store was not consulted')
})

t.test('without the header, a route that requires it answers 400 key-missing and never runs', async (t) => {
  const h = await harness(t, { required: true })
  for (let i = 0; i < 2; i++) {
    const res = await h.post()
    t.equal(res.statusCode, 400)
    t.match(res.headers['content-type'], /^application\/problem\+json/)
    t.match(res.json(), { type: PROBLEM_TYPE('key-missing'), status: 400, title: 'Idempotency-Key is missing' })
  }
  t.equal(h.runs(), 0, 'the handler never ran')
  t.equal(h.claims(), 0, 'nothing was claimed or stored')
  const corrected = await h.post('"now-with-key"')
  t.equal(corrected.statusCode, 201, 'the corrected request executes')
  t.equal(h.runs(), 1)
})

t.test('required: an invalid key is key-invalid, not key-missing', async (t) => {
  const h = await harness(t, { required: true })
  assertInvalid(t, await h.post('""'), 'empty key')
  t.equal(h.runs(), 0)
})

// ---------------------------------------------------------------------------------------------
// Over a real socket: what Node itself does with the bytes on the wire
// ---------------------------------------------------------------------------------------------

interface RawResponse {
  readonly statusCode: number
  readonly headers: Record<string, string>
  readonly body: string
}

async function listen (t: Test, h: Harness): Promise<number> {
  await h.app.listen({ port: 0, host: '127.0.0.1' })
  const address = h.app.server.address()
  if (address === null || typeof address === 'string') throw new Error('no port')
  return address.port
}

/** Sends bytes as they are and reads the response until the server closes the connection. */
function rawRequest (port: number, head: string | Buffer, body = '{"amount":100}'): Promise<RawResponse> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = []
    const socket = net.connect(port, '127.0.0.1', () => {
      socket.end(Buffer.concat([
        Buffer.from('POST /charges HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n' +
          `Content-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n`, 'latin1'),
        typeof head === 'string' ? Buffer.from(head, 'latin1') : head,
        Buffer.from('\r\n' + body, 'latin1')
      ]))
    })
    socket.setTimeout(5000, () => socket.destroy(new Error('raw request timed out')))
    socket.on('data', (chunk: Buffer) => chunks.push(chunk))
    socket.on('error', reject)
    socket.on('close', () => {
      const text = Buffer.concat(chunks).toString('latin1')
      const split = text.indexOf('\r\n\r\n')
      const lines = text.slice(0, split).split('\r\n')
      const status = /^HTTP\/1\.1 (\d{3})/.exec(lines[0] ?? '')
      const headers: Record<string, string> = {}
      for (const line of lines.slice(1)) {
        const colon = line.indexOf(':')
        headers[line.slice(0, colon).toLowerCase()] = line.slice(colon + 1).trim()
      }
      resolve({ statusCode: status === null ? 0 : Number(status[1]), headers, body: text.slice(split + 4) })
    })
  })
}

t.test('over HTTP/1.1, two Idempotency-Key lines are refused with 400', async (t) => {
  const h = await harness(t)
  const port = await listen(t, h)
  const res = await rawRequest(port, 'Idempotency-Key: "abc"\r\nIdempotency-Key: "def"\r\n')
  assertInvalid(t, res, 'two lines')
  t.equal(h.runs(), 0)
})

t.test('over HTTP/1.1, two lines "foo + bar" that Node joins into a valid-looking "foo, bar" are refused', async (t) => {
  const h = await harness(t)
  const port = await listen(t, h)
  const res = await rawRequest(port, 'Idempotency-Key: "foo\r\nidempotency-key: bar"\r\n')
  assertInvalid(t, res, 'split sf-string')
  t.equal(h.runs(), 0)
  t.equal(h.claims(), 0)
})

t.test('over HTTP/1.1, one line "foo, bar" is a single valid key containing a comma', async (t) => {
  const h = await harness(t)
  const port = await listen(t, h)
  const res = await rawRequest(port, 'Idempotency-Key: "foo, bar"\r\n')
  t.equal(res.statusCode, 201)
  t.same(JSON.parse(res.body), { charge: 1, key: 'foo, bar' })
})

t.test('over HTTP/1.1, optional whitespace around the value is ignored', async (t) => {
  const h = await harness(t)
  const port = await listen(t, h)
  const first = await rawRequest(port, 'Idempotency-Key:    "abc"   \r\n')
  t.equal(first.statusCode, 201)
  const second = await rawRequest(port, 'Idempotency-Key:"abc"\r\n')
  t.equal(second.statusCode, 201)
  t.equal(second.headers['idempotent-replayed'], 'true')
  t.equal(h.runs(), 1)
})

t.test('over HTTP/1.1, a UTF-8 key is refused with 400 key-invalid', async (t) => {
  const h = await harness(t)
  const port = await listen(t, h)
  assertInvalid(t, await rawRequest(port, Buffer.from('Idempotency-Key: "clé"\r\n', 'utf8')), 'UTF-8 bytes')
  assertInvalid(t, await rawRequest(port, Buffer.from('Idempotency-Key: "cl\xe9"\r\n', 'latin1')), 'a latin1 byte')
  t.equal(h.runs(), 0)
})

t.test('NUL and control bytes in the header value are refused by Node with 400 before any app code', async (t) => {
  const h = await harness(t)
  const port = await listen(t, h)
  for (const byte of ['\x00', '\x01', '\x7f']) {
    const res = await rawRequest(port, `Idempotency-Key: "a${byte}b"\r\n`)
    t.equal(res.statusCode, 400, `byte 0x${byte.charCodeAt(0).toString(16)} is 400`)
  }
  t.equal(h.runs(), 0, 'the handler never ran')
  t.equal(h.claims(), 0, 'the store was never consulted')
  t.same(h.seen, [], 'no request reached the Fastify lifecycle')
})

t.test('a 17 KiB Idempotency-Key header is refused by Node with 431', async (t) => {
  const h = await harness(t)
  const port = await listen(t, h)
  const res = await rawRequest(port, `Idempotency-Key: "${'k'.repeat(17 * 1024)}"\r\n`)
  t.equal(res.statusCode, 431)
  t.equal(h.runs(), 0)
  t.equal(h.claims(), 0)
})
