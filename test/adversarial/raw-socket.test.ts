import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type IdempotencyOptions } from '../../lib/index.js'
import { assertProblem, counted, errorLog, listen, rawPost, type CountedStore, type RawResponse } from './support.js'

/*
 * Hostile bytes on a real socket (app.inject normalises headers, so these need node:net): repeated
 * field lines, CR/LF and obs-fold inside values, control bytes, oversized header sections. Whoever
 * refuses them (Node's HTTP parser or the plugin), the answer is a clean 4xx, the handler never
 * runs, nothing is claimed, and the server keeps answering.
 */

interface SocketApp {
  readonly app: FastifyInstance
  readonly port: number
  readonly store: CountedStore
  readonly runs: () => number
  readonly errors: string[]
}

async function socketApp (t: Test, options: IdempotencyOptions = {}): Promise<SocketApp> {
  const log = errorLog()
  const app = Fastify({ logger: log.logger })
  const store = counted(memoryStore({ purgeInterval: 0 }))
  t.teardown(() => app.close())
  await app.register(idempotency, { store, scope: () => 'test', ...options })
  let runs = 0
  app.post('/orders', async (request, reply) => {
    runs++
    return reply.code(201).header('location', '/orders/1').send({ key: request.idempotency?.key })
  })
  const port = await listen(app)
  return { app, port, store, runs: () => runs, errors: log.lines }
}

/** Node's parser refused the message: Fastify's clientError answer (not a plugin problem). */
function isParserRefusal (res: RawResponse, status: number): boolean {
  return res.statusCode === status && /^application\/json/.test(res.headers['content-type'] ?? '') &&
    (JSON.parse(res.body) as { statusCode?: number }).statusCode === status
}

const keyInvalid = (t: Test, res: RawResponse, what: string): void => {
  t.doesNotThrow(() => assertProblem(res, 'key-invalid', 400, what), `${what}: 400 key-invalid problem`)
}

/** The server still works after the abuse: a valid request executes, and its retry replays. */
async function stillServes (t: Test, h: SocketApp, key: string): Promise<void> {
  const runs = h.runs()
  const first = await rawPost(h.port, '/orders', `Idempotency-Key: "${key}"\r\n`)
  t.equal(first.statusCode, 201, 'afterwards a valid request executes')
  t.same(JSON.parse(first.body), { key })
  const again = await rawPost(h.port, '/orders', `Idempotency-Key: "${key}"\r\n`)
  t.equal(again.headers['idempotent-replayed'], 'true', 'and its retry replays')
  t.equal(h.runs(), runs + 1, 'one execution')
  t.same(h.errors, [], 'nothing was logged at error level')
}

t.test('two Idempotency-Key field lines are a 400, whatever their values (RFC 9110 §5.3, RFC 9651 §4.2)', async (t) => {
  const h = await socketApp(t)
  const cases: ReadonlyArray<readonly [string, string]> = [
    ['two different keys', 'Idempotency-Key: "abc"\r\nIdempotency-Key: "def"\r\n'],
    ['the same key twice', 'Idempotency-Key: "abc"\r\nidempotency-key: "abc"\r\n'],
    ['a split sf-string that Node joins into "foo, bar"', 'Idempotency-Key: "foo\r\nIDEMPOTENCY-KEY: bar"\r\n'],
    ['a bare key and a quoted one', 'Idempotency-Key: abc\r\nIdempotency-Key: "abc"\r\n'],
    ['a valid line and an empty one', 'Idempotency-Key: "abc"\r\nIdempotency-Key:\r\n'],
    ['three lines', 'Idempotency-Key: "a"\r\nIdempotency-Key: "b"\r\nIdempotency-Key: "c"\r\n']
  ]
  for (const [what, lines] of cases) keyInvalid(t, await rawPost(h.port, '/orders', lines), what)
  t.equal(h.runs(), 0, 'the handler never ran')
  t.equal(h.store.claims(), 0, 'nothing was claimed')
  await stillServes(t, h, 'after-two-lines')
})

t.test('CR, LF and obs-fold inside a value are refused by Node before the plugin (no header injection)', async (t) => {
  const h = await socketApp(t)
  const cases: ReadonlyArray<readonly [string, string]> = [
    ['a bare CR inside the quotes', 'Idempotency-Key: "a\rb"\r\n'],
    ['a bare LF starting a forged header line', 'Idempotency-Key: "a\nX-Injected: 1"\r\n'],
    ['a bare CR starting a forged Idempotency-Key', 'Idempotency-Key: "a"\rIdempotency-Key: "b"\r\n'],
    ['obs-fold with a space (RFC 9112 §5.2)', 'Idempotency-Key: "abc"\r\n "def"\r\n'],
    ['obs-fold with a tab inside the quotes', 'Idempotency-Key: "abc\r\n\tdef"\r\n'],
    ['a space before the colon', 'Idempotency-Key : "abc"\r\n'],
    ['a field line without a name', ': "abc"\r\n']
  ]
  for (const [what, lines] of cases) {
    const res = await rawPost(h.port, '/orders', lines)
    t.ok(isParserRefusal(res, 400), `${what}: Node's parser answers 400 (${JSON.stringify(res.text.slice(0, 40))})`)
  }
  t.equal(h.runs(), 0, 'the handler never ran')
  t.equal(h.store.claims(), 0, 'nothing was claimed')
  await stillServes(t, h, 'after-injection')
})

t.test('a key that spells a header line is just a key: never reflected into response headers', async (t) => {
  const h = await socketApp(t)
  // Escaped backslashes, not CR/LF: an sf-string cannot hold control characters.
  const key = 'x\\r\\nSet-Cookie: session=stolen\\r\\n'
  const wire = `"${key.replace(/\\/g, '\\\\')}"`
  const first = await rawPost(h.port, '/orders', `Idempotency-Key: ${wire}\r\n`)
  const again = await rawPost(h.port, '/orders', `Idempotency-Key: ${wire}\r\n`)
  t.equal(first.statusCode, 201)
  t.same(JSON.parse(first.body), { key }, 'the handler saw the characters as sent')
  t.equal(again.headers['idempotent-replayed'], 'true')
  for (const res of [first, again]) {
    t.equal(res.headers['set-cookie'], undefined, 'no Set-Cookie header')
    const head = res.text.slice(0, res.text.indexOf('\r\n\r\n'))
    t.notOk(head.includes('stolen'), 'the key appears nowhere in the response head')
  }
  t.equal(h.runs(), 1)
})

t.test('every control byte, DEL and obs-text byte inside a key is a 400; only the parser or the plugin answers', async (t) => {
  const h = await socketApp(t)
  const refusedBy = { parser: [] as string[], plugin: [] as string[] }
  const bytes = [...Array.from({ length: 0x20 }, (_, b) => b), 0x7f, ...Array.from({ length: 0x80 }, (_, b) => 0x80 + b)]
  for (const byte of bytes) {
    const hex = `0x${byte.toString(16).padStart(2, '0')}`
    const line = Buffer.concat([Buffer.from('Idempotency-Key: "a', 'latin1'), Buffer.from([byte]), Buffer.from('b"\r\n', 'latin1')])
    const res = await rawPost(h.port, '/orders', line)
    if (isParserRefusal(res, 400)) {
      refusedBy.parser.push(hex)
    } else {
      keyInvalid(t, res, `byte ${hex}`)
      refusedBy.plugin.push(hex)
    }
  }
  t.equal(h.runs(), 0, 'the handler never ran')
  t.equal(h.store.claims(), 0, 'nothing was claimed')
  // What Node 20's llhttp lets through to the plugin: HTAB (a legal field-value byte) and obs-text.
  t.same(refusedBy.plugin, ['0x09', ...Array.from({ length: 0x80 }, (_, b) => `0x${(0x80 + b).toString(16)}`)],
    'HTAB and obs-text bytes reach the plugin, which refuses them as non-sf-string characters')
  t.equal(refusedBy.parser.length, 0x20, 'NUL, the other C0 controls and DEL are refused by Node\'s parser')
  await stillServes(t, h, 'after-control-bytes')
})

t.test('oversized header sections: 431 from Node, or 400 key-invalid from the plugin; never a crash', async (t) => {
  t.test('a 16 KiB key exceeds Node\'s 16 KiB header limit: 431', async (t) => {
    const h = await socketApp(t, { maxKeyLength: 8192 })
    const res = await rawPost(h.port, '/orders', `Idempotency-Key: "${'k'.repeat(16 * 1024)}"\r\n`)
    t.ok(isParserRefusal(res, 431), `431 Request Header Fields Too Large (${res.statusCode})`)
    t.equal(h.runs(), 0)
    t.equal(h.store.claims(), 0)
    await stillServes(t, h, 'after-431')
  })

  t.test('an 8 KiB key under the default maxKeyLength (255): 400 key-invalid', async (t) => {
    const h = await socketApp(t)
    keyInvalid(t, await rawPost(h.port, '/orders', `Idempotency-Key: "${'k'.repeat(8 * 1024)}"\r\n`), '8 KiB key')
    t.equal(h.runs(), 0)
    t.equal(h.store.claims(), 0)
    await stillServes(t, h, 'after-8k')
  })

  t.test('the largest maxKeyLength (8192) works end to end over HTTP', async (t) => {
    const h = await socketApp(t, { maxKeyLength: 8192 })
    const key = 'k'.repeat(8192)
    const first = await rawPost(h.port, '/orders', `Idempotency-Key: "${key}"\r\n`)
    t.equal(first.statusCode, 201)
    const again = await rawPost(h.port, '/orders', `Idempotency-Key: "${key}"\r\n`)
    t.equal(again.headers['idempotent-replayed'], 'true', 'an 8192-character key replays')
    keyInvalid(t, await rawPost(h.port, '/orders', `Idempotency-Key: "${key}k"\r\n`), '8193 characters')
    t.equal(h.runs(), 1)
  })

  t.test('many small header lines adding up past the limit: 431', async (t) => {
    const h = await socketApp(t)
    const filler = Array.from({ length: 400 }, (_, i) => `X-Filler-${i}: ${'f'.repeat(40)}\r\n`).join('')
    const res = await rawPost(h.port, '/orders', `Idempotency-Key: "abc"\r\n${filler}`)
    t.ok(isParserRefusal(res, 431), `431 (${res.statusCode})`)
    t.equal(h.runs(), 0)
    t.equal(h.store.claims(), 0)
    await stillServes(t, h, 'after-filler')
  })
})
