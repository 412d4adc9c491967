import http from 'node:http'
import type { AddressInfo } from 'node:net'
import { Readable } from 'node:stream'
import type { FastifyInstance, FastifyReply, FastifyRequest, LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import { DEFAULT_REPLAY_HEADERS, memoryStore } from '../../lib/index.js'
import type { IdempotencyStore, StoredRecord } from '../../lib/core/store.js'
import { buildApp, keyed, PROBLEM_TYPE } from '../helpers/app.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Behaviour 14: every payload type Fastify's onSend can carry is recorded and replayed byte for byte
 * with its status and Content-Type; a body over `maxResponseBytes` is sent whole once, never
 * replayed truncated and never re-executed; a stream is recorded as it streams.
 */

const BODY = { amount: 1 }

function post (app: FastifyInstance, url: string, key: string): Promise<LightMyRequestResponse> {
  return app.inject({ method: 'POST', url, headers: keyed(key), payload: BODY })
}

type Handler = (request: FastifyRequest, reply: FastifyReply) => unknown

/** Registers `url` with a counting handler. */
function route (app: FastifyInstance, url: string, handler: Handler, config?: Record<string, unknown>): () => number {
  let executions = 0
  const counted = async (request: FastifyRequest, reply: FastifyReply): Promise<unknown> => {
    executions++
    return handler(request, reply)
  }
  if (config === undefined) app.post(url, counted)
  else app.post(url, { config: { idempotency: config } }, counted)
  return () => executions
}

interface Expected {
  readonly status: number
  readonly body: Buffer
  /** The Content-Type both responses carry; undefined for none. */
  readonly contentType: string | undefined
}

/** The original carries exactly `expected`; the retry replays it byte for byte; the handler ran once. */
async function assertRecordedAndReplayed (t: Test, app: FastifyInstance, url: string, count: () => number, expected: Expected): Promise<{ first: LightMyRequestResponse, replay: LightMyRequestResponse }> {
  const key = `key-${url}`
  const first = await post(app, url, key)
  t.equal(first.statusCode, expected.status, 'original status')
  t.ok(first.rawPayload.equals(expected.body), 'original body bytes')
  t.equal(first.headers['content-type'], expected.contentType, 'original Content-Type')
  t.equal(first.headers['idempotent-replayed'], undefined, 'the original is not marked replayed')

  const replay = await post(app, url, key)
  t.equal(replay.statusCode, expected.status, 'replayed status')
  t.ok(replay.rawPayload.equals(expected.body), `replayed body is byte-identical (${JSON.stringify(replay.rawPayload.toString('latin1'))})`)
  t.equal(replay.headers['content-type'], expected.contentType, 'replayed Content-Type')
  t.equal(replay.headers['idempotent-replayed'], 'true', 'marked replayed')
  t.equal(count(), 1, 'the handler ran once')
  return { first, replay }
}

t.test('an object (serialised to JSON) is recorded and replayed', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/object', (_request, reply) => {
    reply.code(201)
    return { id: 'pay_1', amount: 100, nested: { list: [1, 'two', null], unicode: 'é€😀' } }
  })
  await assertRecordedAndReplayed(t, app, '/object', count, {
    status: 201,
    body: Buffer.from(JSON.stringify({ id: 'pay_1', amount: 100, nested: { list: [1, 'two', null], unicode: 'é€😀' } })),
    contentType: 'application/json; charset=utf-8'
  })
})

t.test('a JSON string sent with reply.type(application/json) is recorded and replayed as is', async (t) => {
  const app = await buildApp(t)
  const text = '{ "b" : 2,  "a":1 }' // odd spacing: replay must not re-serialise it
  const count = route(app, '/json-string', (_request, reply) => {
    reply.type('application/json')
    return text
  })
  // Fastify adds the utf-8 charset to a JSON type set without one.
  await assertRecordedAndReplayed(t, app, '/json-string', count, { status: 200, body: Buffer.from(text), contentType: 'application/json; charset=utf-8' })
})

t.test('a plain string is recorded and replayed as text/plain', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/string', () => 'hello, wörld')
  await assertRecordedAndReplayed(t, app, '/string', count, { status: 200, body: Buffer.from('hello, wörld'), contentType: 'text/plain; charset=utf-8' })
})

t.test('a Buffer is recorded and replayed as application/octet-stream', async (t) => {
  const app = await buildApp(t)
  const bytes = Buffer.from([0, 1, 2, 0x7f, 0x80, 0xfe, 0xff])
  const count = route(app, '/buffer', (_request, reply) => {
    reply.code(201)
    return bytes
  })
  await assertRecordedAndReplayed(t, app, '/buffer', count, { status: 201, body: bytes, contentType: 'application/octet-stream' })
})

t.test('a Node Readable stream is captured as it streams and replayed', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/node-stream', (_request, reply) => {
    reply.code(201).type('text/plain; charset=utf-8')
    return Readable.from([Buffer.from('one,'), 'two,', Buffer.from('thr'), Buffer.from('ee')])
  })
  await assertRecordedAndReplayed(t, app, '/node-stream', count, { status: 201, body: Buffer.from('one,two,three'), contentType: 'text/plain; charset=utf-8' })
})

t.test('a stream sent without a Content-Type is replayed with the same Content-Type as the original', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/untyped-stream', () => Readable.from([Buffer.from([1, 2, 3]), Buffer.from([4, 5])]))
  const first = await post(app, '/untyped-stream', 'untyped')
  const replay = await post(app, '/untyped-stream', 'untyped')
  t.ok(replay.rawPayload.equals(first.rawPayload), 'same bytes')
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal(replay.headers['content-type'], first.headers['content-type'], 'a replay carries the Content-Type the original carried, no more, no less')
  t.equal(count(), 1)
})

t.test('a web ReadableStream is captured and replayed', async (t) => {
  const app = await buildApp(t)
  const encoder = new TextEncoder()
  const count = route(app, '/web-stream', (_request, reply) => {
    reply.type('application/x-ndjson')
    return new ReadableStream<Uint8Array>({
      start (controller) {
        controller.enqueue(encoder.encode('{"n":1}\n'))
        controller.enqueue(encoder.encode('{"n":2}\n'))
        controller.close()
      }
    })
  })
  await assertRecordedAndReplayed(t, app, '/web-stream', count, { status: 200, body: Buffer.from('{"n":1}\n{"n":2}\n'), contentType: 'application/x-ndjson' })
})

t.test('a fetch Response: its status and headers are sent, recorded and replayed', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/response', () => new Response('id,amount\n1,100\n', {
    status: 202,
    headers: { 'content-type': 'text/csv', 'x-a': '1' }
  }), { replayHeaders: [...DEFAULT_REPLAY_HEADERS, 'x-a'] })
  const { first, replay } = await assertRecordedAndReplayed(t, app, '/response', count, {
    status: 202,
    body: Buffer.from('id,amount\n1,100\n'),
    contentType: 'text/csv'
  })
  t.equal(first.headers['x-a'], '1', 'the Response\'s own header is sent')
  t.equal(replay.headers['x-a'], '1', 'and replayed when listed in replayHeaders')
})

t.test('a fetch Response with no body is recorded and replayed with its status', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/response-empty', () => new Response(null, { status: 202, headers: { location: '/jobs/7' } }))
  const first = await post(app, '/response-empty', 'resp-empty')
  const replay = await post(app, '/response-empty', 'resp-empty')
  t.equal(first.statusCode, 202)
  t.equal(first.headers.location, '/jobs/7')
  t.equal(replay.statusCode, 202)
  t.equal(replay.headers.location, '/jobs/7')
  t.equal(replay.body, '')
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal(count(), 1)
})

t.test('reply.send() with no body is recorded and replayed as an empty 200', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/empty', (_request, reply) => reply.send())
  await assertRecordedAndReplayed(t, app, '/empty', count, { status: 200, body: Buffer.alloc(0), contentType: undefined })
})

t.test('a 204 is recorded and replayed as a 204 without a body', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/no-content', (_request, reply) => reply.code(204).send())
  await assertRecordedAndReplayed(t, app, '/no-content', count, { status: 204, body: Buffer.alloc(0), contentType: undefined })
})

t.test('null is recorded and replayed as the JSON null Fastify sends for it', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/null', (_request, reply) => reply.send(null))
  await assertRecordedAndReplayed(t, app, '/null', count, { status: 200, body: Buffer.from('null'), contentType: 'application/json; charset=utf-8' })
})

t.test('an empty string is recorded and replayed as an empty body', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/empty-string', (_request, reply) => { reply.code(201); return '' })
  const first = await post(app, '/empty-string', 'es')
  const replay = await post(app, '/empty-string', 'es')
  t.equal(first.statusCode, 201)
  t.equal(replay.statusCode, 201)
  t.equal(replay.body, '')
  t.equal(replay.headers['content-type'], first.headers['content-type'])
  t.equal(replay.headers['idempotent-replayed'], 'true')
  t.equal(count(), 1)
})

async function assertNotRetained (t: Test, app: FastifyInstance, url: string, count: () => number, status: number, size: number): Promise<void> {
  const first = await post(app, url, `big-${url}`)
  t.equal(first.statusCode, status)
  t.equal(first.rawPayload.length, size, 'the first client gets the whole body')
  t.ok(first.rawPayload.equals(Buffer.alloc(size, 'x')), 'every byte of it')

  const retry = await post(app, url, `big-${url}`)
  t.equal(retry.statusCode, 410, 'the retry gets 410')
  t.match(String(retry.headers['content-type']), /^application\/problem\+json/)
  const problem = JSON.parse(retry.body) as Record<string, unknown>
  t.equal(problem.type, PROBLEM_TYPE('response-not-retained'))
  t.equal(problem.status, 410)
  t.equal(problem.originalStatus, status, 'the problem names the original status')
  t.equal(retry.headers['idempotent-replayed'], undefined, 'it is not a (truncated) replay')
  t.equal(count(), 1, 'the handler is not run again')

  const again = await post(app, url, `big-${url}`)
  t.equal(again.statusCode, 410, 'every later retry too')
  t.equal(count(), 1)
}

t.test('a stream over maxResponseBytes is sent whole, then retries get 410 response-not-retained and never re-execute', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/big-stream', (_request, reply) => {
    reply.code(201).type('text/plain')
    return Readable.from([Buffer.alloc(60, 'x'), Buffer.alloc(60, 'x'), Buffer.alloc(60, 'x')])
  }, { maxResponseBytes: 100 })
  await assertNotRetained(t, app, '/big-stream', count, 201, 180)
})

t.test('a non-stream body over maxResponseBytes: the same 410, never re-executed', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/big-buffer', (_request, reply) => {
    reply.code(200).type('text/plain')
    return 'x'.repeat(101)
  }, { maxResponseBytes: 100 })
  await assertNotRetained(t, app, '/big-buffer', count, 200, 101)
})

t.test('a body of exactly maxResponseBytes is retained and replayed', async (t) => {
  const app = await buildApp(t)
  const count = route(app, '/exact', (_request, reply) => {
    reply.type('text/plain')
    return Readable.from([Buffer.alloc(50, 'y'), Buffer.alloc(50, 'y')])
  }, { maxResponseBytes: 100 })
  await assertRecordedAndReplayed(t, app, '/exact', count, { status: 200, body: Buffer.alloc(100, 'y'), contentType: 'text/plain' })
})

t.test('a stream that errors mid-way after the handler returned: the key is held (its effect may have happened); after markDefinite() it is released and the retry executes', async (t) => {
  for (const definite of [false, true]) {
    const store = memoryStore({ purgeInterval: 0 })
    t.teardown(() => store.close())
    const app = await buildApp(t, { plugin: { store } })
    let executions = 0
    app.post('/flaky', async (request, reply) => {
      executions++
      reply.type('text/plain')
      if (executions === 1) {
        // A handler that knows its stream only reads (nothing happened if it breaks) says so.
        if (definite) request.idempotency?.markDefinite()
        let reads = 0
        return new Readable({
          read () {
            if (reads++ === 0) this.push('partial ')
            else this.destroy(new Error('upstream broke'))
          }
        })
      }
      return Readable.from(['complete ', 'body'])
    })

    // The client sees a broken response (Fastify destroys it once headers are out).
    await t.rejects(post(app, '/flaky', 'flaky'), 'the first response is cut off')
    if (!definite) {
      t.match(await store.inspect({ scope: 'test', key: 'flaky' }), { state: 'in_progress', indeterminate: true, response: null },
        'nothing recorded; the key is held for the reconciler, not released')
      const retry = await post(app, '/flaky', 'flaky')
      t.equal(retry.statusCode, 409, 'a retry is refused while the key is held')
      t.equal(executions, 1, 'the handler ran once')
      continue
    }
    t.equal(await store.get({ scope: 'test', key: 'flaky' }), null, 'markDefinite(): the key was released, nothing recorded')
    const retry = await post(app, '/flaky', 'flaky')
    t.equal(retry.statusCode, 200)
    t.equal(retry.body, 'complete body', 'the retry executed and got a full body')
    t.equal(retry.headers['idempotent-replayed'], undefined)
    t.equal(executions, 2)
    const replay = await post(app, '/flaky', 'flaky')
    t.equal(replay.body, 'complete body')
    t.equal(replay.headers['idempotent-replayed'], 'true')
    t.equal(executions, 2)
  }
})

/** A stream of `n` chunks, one every `ms`; `onEnd` runs after the last chunk was produced. */
function slowStream (n: number, ms: number, onEnd: () => void = () => {}): Readable {
  async function * chunks (): AsyncGenerator<Buffer> {
    for (let i = 0; i < n; i++) {
      if (i > 0) await sleep(ms)
      yield Buffer.from(`chunk-${i};`)
    }
    onEnd()
  }
  return Readable.from(chunks())
}
const slowBody = (n: number): string => Array.from({ length: n }, (_, i) => `chunk-${i};`).join('')

async function listen (t: Test, app: FastifyInstance): Promise<number> {
  await app.listen({ host: '127.0.0.1', port: 0 })
  return (app.server.address() as AddressInfo).port
}

async function until (t: Test, predicate: () => Promise<boolean>, what: string, limitMs = 3000): Promise<void> {
  const deadline = Date.now() + limitMs
  while (!(await predicate())) {
    if (Date.now() > deadline) {
      t.fail(`timed out waiting for ${what}`)
      return
    }
    await sleep(10)
  }
}

t.test('a client that aborts mid-stream: the stream is read to its end, recorded, and a retry replays the full body', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store } })
  let produced = false
  const count = route(app, '/slow', (_request, reply) => {
    reply.code(201).type('text/plain')
    return slowStream(10, 20, () => { produced = true })
  })
  const port = await listen(t, app)

  const received = await new Promise<string>((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port, agent: false, method: 'POST', path: '/slow', headers: keyed('abort') }, (res) => {
      res.once('data', (chunk: Buffer) => {
        req.destroy() // the client goes away after the first chunk
        resolve(chunk.toString())
      })
    })
    req.on('error', (err: NodeJS.ErrnoException) => { if (err.code !== 'ECONNRESET') reject(err) })
    req.end(JSON.stringify(BODY))
  })
  t.ok(received.length > 0 && received.length < slowBody(10).length && slowBody(10).startsWith(received), `the client only saw the beginning (${JSON.stringify(received)})`)

  await until(t, async () => (await store.get({ scope: 'test', key: 'abort' }))?.state === 'completed', 'the response to be recorded')
  t.ok(produced, 'the stream was read to its end')
  const record = await store.get({ scope: 'test', key: 'abort' }) as StoredRecord
  t.equal(record.state === 'completed' ? record.response.body?.toString() : null, slowBody(10), 'the whole body was recorded')

  const retry = await post(app, '/slow', 'abort')
  t.equal(retry.statusCode, 201)
  t.equal(retry.headers['idempotent-replayed'], 'true')
  t.equal(retry.body, slowBody(10), 'the retry replays the full body')
  t.equal(count(), 1, 'the handler ran once')
})

/** A memory store whose complete takes 200 ms, noting when it resolved. */
function slowCompleteStore (): { store: IdempotencyStore, completedAt: () => number | null } {
  const base = memoryStore({ purgeInterval: 0 })
  let completedAt: number | null = null
  return {
    completedAt: () => completedAt,
    store: {
      ...base,
      complete: async (lease, response, ttl) => {
        await sleep(200)
        const done = await base.complete(lease, response, ttl)
        completedAt = Date.now()
        return done
      }
    }
  }
}

interface Observed { firstChunkAt: number, lastChunkAt: number, endAt: number, completedAtFirstChunk: number | null, completedAtLastChunk: number | null, completedAtEnd: number | null, body: string }

/** POSTs over real HTTP, noting at each client event whether the record was already stored. */
function observe (port: number, url: string, key: string, completedAt: () => number | null): Promise<Observed> {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: '127.0.0.1', port, agent: false, method: 'POST', path: url, headers: keyed(key) }, (res) => {
      const seen: Partial<Observed> = {}
      let body = ''
      res.on('data', (chunk: Buffer) => {
        const at = Date.now()
        if (seen.firstChunkAt === undefined) {
          seen.firstChunkAt = at
          seen.completedAtFirstChunk = completedAt()
        }
        seen.lastChunkAt = at
        seen.completedAtLastChunk = completedAt()
        body += chunk.toString()
      })
      res.on('end', () => {
        resolve({ ...seen, endAt: Date.now(), completedAtEnd: completedAt(), body } as Observed)
      })
      res.on('error', reject)
    })
    req.on('error', reject)
    req.end(JSON.stringify(BODY))
  })
}

t.test('a streamed response does not finish before its record is stored', async (t) => {
  const { store, completedAt } = slowCompleteStore()
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store } })
  const count = route(app, '/streamed', (_request, reply) => {
    reply.type('text/plain')
    return slowStream(5, 20)
  })
  const port = await listen(t, app)

  const seen = await observe(port, '/streamed', 'ordered', completedAt)
  t.equal(seen.body, slowBody(5))
  t.equal(seen.completedAtFirstChunk, null, 'the first bytes flowed while the stream was still being captured')
  t.not(seen.completedAtEnd, null, 'when the response finished, the record was already stored')
  t.ok((seen.completedAtEnd ?? Infinity) <= seen.endAt, 'complete resolved before the end of the response')

  const retry = await post(app, '/streamed', 'ordered')
  t.equal(retry.headers['idempotent-replayed'], 'true', 'a retry right after the end replays')
  t.equal(count(), 1)
})

t.test('a streamed response with a Content-Length: the client has the last byte only after the record is stored', async (t) => {
  const { store, completedAt } = slowCompleteStore()
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store } })
  const count = route(app, '/sized', (_request, reply) => {
    reply.type('text/plain').header('content-length', String(Buffer.byteLength(slowBody(5))))
    return slowStream(5, 20)
  })
  const port = await listen(t, app)

  const seen = await observe(port, '/sized', 'sized', completedAt)
  t.equal(seen.body, slowBody(5))
  // With a Content-Length, a client considers the response complete at its last byte, and may
  // retry at once: the record must exist by then.
  t.not(seen.completedAtLastChunk, null, 'when the last byte arrived, the record was already stored')
  await until(t, async () => completedAt() !== null, 'the record to be stored')
  t.equal(count(), 1)
})

t.test('a non-stream response is sent only after its record is stored', async (t) => {
  const { store, completedAt } = slowCompleteStore()
  t.teardown(() => store.close())
  const app = await buildApp(t, { plugin: { store } })
  route(app, '/plain', () => ({ ok: true }))
  const port = await listen(t, app)
  const seen = await observe(port, '/plain', 'plain', completedAt)
  t.equal(seen.body, '{"ok":true}')
  t.not(seen.completedAtFirstChunk, null, 'the first byte left after complete resolved')
})
