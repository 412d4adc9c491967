import { createHash, randomBytes } from 'node:crypto'
import { createServer, connect, type AddressInfo, type Server, type Socket } from 'node:net'
import { Cluster, Redis, type Callback } from 'ioredis'
import t, { type Test } from 'tap'
import { InvalidOptionError } from '../../lib/core/errors.js'
import type { IdempotencyPrefilter } from '../../lib/core/prefilter.js'
import type { Fingerprint, RecordId, StoredResponse } from '../../lib/core/store.js'
import { redisPrefilter, type RedisPrefilter } from '../../drivers/redis/index.js'
import { recordKey } from '../../drivers/redis/keys.js'
import { pipelining } from '../../drivers/redis/pipelining.js'
import { sleep } from '../helpers/sleep.js'
import { clusterNodes } from '../helpers/redis-nodes.js'

/**
 * The Redis pre-filter against real servers: one standalone (REDIS_URL) and a 3-master cluster
 * (REDIS_CLUSTER_NODES); `node scripts/test.mjs test/redis/redis.test.ts` provisions both. Every
 * test writes under a random prefix of its own.
 */

const REDIS_URL = process.env.REDIS_URL ?? ''
const CLUSTER_NODES = process.env.REDIS_CLUSTER_NODES ?? ''

const fp = (text: string, algorithm = 'canonical-v1'): Fingerprint => ({ algorithm, digest: createHash('sha256').update(text).digest() })
const A = fp('request A')
const newPrefix = (): string => `idemtest-${randomBytes(6).toString('hex')}`
const binary = Buffer.from([0x00, 0xff, 0x7b, 0x7d, 0x0a, 0x00, 0xfe, 0x80])
const RESPONSE: StoredResponse = {
  statusCode: 201,
  headers: { 'content-type': 'application/octet-stream', 'set-cookie': ['a=1', 'b="2"'], 'x-empty': '' },
  body: binary
}
const LONG = 60_000

let unhandled = 0
process.on('unhandledRejection', () => { unhandled++ })

if (REDIS_URL === '' || CLUSTER_NODES === '') {
  t.fail('REDIS_URL and REDIS_CLUSTER_NODES must be set: the Redis pre-filter tests need a standalone Redis and a ' +
    'Redis Cluster. Run `node scripts/test.mjs test/redis/redis.test.ts` (it starts throwaway servers and sets both), ' +
    'or set REDIS_URL=redis://… and REDIS_CLUSTER_NODES=host:port,host:port,host:port.')
} else {
  const nodes = clusterNodes(CLUSTER_NODES)
  // A database of its own: test files run in parallel on one server, and this one flushes its database.
  const standalone = new Redis(REDIS_URL, { db: 1 })
  const cluster = new Cluster(nodes)
  t.teardown(() => {
    standalone.disconnect()
    cluster.disconnect()
  })
  t.test('standalone', async (t) => { suite(t, standalone) })
  t.test('cluster', async (t) => { suite(t, cluster) })
  t.test('standalone only', async (t) => { standaloneOnly(t, standalone) })
  t.test('cluster only', async (t) => { clusterOnly(t, cluster) })
  t.test('options', async (t) => { optionTests(t, standalone) })
  t.test('no unhandled rejection', async (t) => {
    await sleep(400) // late replies from the timeout tests have arrived by now
    t.equal(unhandled, 0)
  })
}

function suite (t: Test, client: Redis | Cluster): void {
  const make = (): { pf: RedisPrefilter, prefix: string } => {
    const prefix = newPrefix()
    return { pf: redisPrefilter({ client, prefix, timeout: 2000 }), prefix }
  }
  const id = (key: string, scope = 'tenant'): RecordId => ({ scope, key })

  t.test('a miss is null', async (t) => {
    const { pf } = make()
    t.equal(await pf.lookup(id('nothing')), null)
  })

  t.test('markInFlight then lookup: in_progress with the fingerprint', async (t) => {
    const { pf } = make()
    const digest = Buffer.from([0x00, 0xff, 0x00, 0x01])
    await pf.markInFlight(id('k'), { algorithm: 'raw-v1', digest }, LONG)
    const hit = await pf.lookup(id('k'))
    t.equal(hit?.state, 'in_progress')
    t.equal(hit?.fingerprint.algorithm, 'raw-v1')
    t.ok(hit?.fingerprint.digest.equals(digest))
  })

  t.test('remember then lookup: completed, byte-identical', async (t) => {
    const { pf } = make()
    const cases: Array<[string, StoredResponse]> = [
      ['binary', RESPONSE],
      ['empty', { statusCode: 204, headers: {}, body: Buffer.alloc(0) }],
      ['null', { statusCode: 200, headers: { 'content-type': 'text/plain' }, body: null }]
    ]
    for (const [key, response] of cases) {
      await pf.markInFlight(id(key), A, LONG)
      await pf.remember(id(key), A, response, LONG)
      const hit = await pf.lookup(id(key))
      if (hit?.state !== 'completed') {
        t.fail(`${key}: expected completed, got ${String(hit?.state)}`)
        continue
      }
      t.equal(hit.fingerprint.algorithm, A.algorithm, key)
      t.ok(hit.fingerprint.digest.equals(A.digest), key)
      t.equal(hit.response.statusCode, response.statusCode, key)
      t.same(hit.response.headers, response.headers, key)
      t.same(Object.keys(hit.response.headers), Object.keys(response.headers), `${key}: header order`)
      if (response.body === null) t.equal(hit.response.body, null, `${key}: null body stays null`)
      else t.ok(Buffer.isBuffer(hit.response.body) && hit.response.body.equals(response.body), `${key}: body bytes`)
    }
  })

  t.test('lookupOrMark: what is there is the answer, and nothing there becomes the caller\'s marker', async (t) => {
    const { pf } = make()
    const lookupOrMark = pf.lookupOrMark as NonNullable<IdempotencyPrefilter['lookupOrMark']>
    t.same(await lookupOrMark(id('fresh'), A, LONG), { hit: null, marked: true }, 'a miss, and marked')
    const marker = await pf.lookup(id('fresh'))
    t.equal(marker?.state, 'in_progress')
    t.ok(marker?.fingerprint.digest.equals(A.digest), 'with the caller\'s fingerprint')
    const again = await lookupOrMark(id('fresh'), fp('other'), LONG)
    t.equal(again.marked, false, 'a marker is there: nothing written')
    t.ok(again.hit?.fingerprint.digest.equals(A.digest), 'and it is the answer, as a lookup would give')

    await pf.remember(id('done'), A, RESPONSE, LONG)
    const done = await lookupOrMark(id('done'), fp('other'), LONG)
    t.equal(done.marked, false)
    t.equal(done.hit?.state, 'completed', 'a completed record is returned, never replaced')
    if (done.hit?.state === 'completed') t.ok(done.hit.response.body?.equals(RESPONSE.body as Buffer), 'byte-identical')

    t.same(await lookupOrMark(id('no-lease'), A, 0), { hit: null, marked: false }, 'a ttl of 0 only looks')
    t.equal(await pf.lookup(id('no-lease')), null)
  })

  t.test('markInFlight never overwrites a completed record', async (t) => {
    const { pf } = make()
    await pf.remember(id('k'), A, RESPONSE, LONG)
    await pf.markInFlight(id('k'), fp('other'), LONG)
    const hit = await pf.lookup(id('k'))
    t.equal(hit?.state, 'completed')
    t.ok(hit?.fingerprint.digest.equals(A.digest))
  })

  t.test('clearInFlight removes the request\'s marker, not a completed record', async (t) => {
    const { pf } = make()
    const marker = id('marker') // one request: one RecordId for all its calls, as the core passes
    await pf.markInFlight(marker, A, LONG)
    await pf.clearInFlight(marker)
    t.equal(await pf.lookup(id('marker')), null)
    const done = id('done')
    await pf.markInFlight(done, A, LONG)
    await pf.remember(done, A, RESPONSE, LONG)
    await pf.clearInFlight(done)
    t.equal((await pf.lookup(id('done')))?.state, 'completed')
    const absent = id('absent')
    await pf.markInFlight(absent, A, 1)
    await sleep(10)
    await pf.clearInFlight(absent) // its marker expired: nothing there, no error
    await pf.clearInFlight(id('never')) // a request that never marked: nothing of its own to clear
  })

  t.test('markers name their owner: each request knows its own, and clears only its own', async (t) => {
    const { pf, prefix } = make()
    const lookupOrMark = pf.lookupOrMark as NonNullable<IdempotencyPrefilter['lookupOrMark']>
    const owner = (key: string): Promise<string | null> => client.hget(recordKey(prefix, id(key)), 'owner')
    /** The marker's state and owner, as Redis holds them. */
    const marker = (key: string): Promise<Array<string | null>> => client.hmget(recordKey(prefix, id(key)), 'state', 'owner')

    t.test('lookupOrMark finding the request\'s own marker: marked, no hit, nothing rewritten', async (t) => {
      const request = id('own')
      const { hits, misses } = pf.stats
      t.same(await lookupOrMark(request, A, LONG), { hit: null, marked: true })
      const token = await owner('own')
      t.ok(token !== null && token.length >= 32, 'the marker carries a token')
      const pttl = await client.pttl(recordKey(prefix, request))
      t.same(await lookupOrMark(request, fp('other'), LONG), { hit: null, marked: true }, 'its own marker, whatever it is asked with')
      t.same([pf.stats.hits, pf.stats.misses], [hits, misses + 2], 'counted as the misses they were, not as hits')
      t.equal(await owner('own'), token, 'same token')
      const seen = await pf.lookup(id('own'))
      t.ok(seen?.state === 'in_progress' && seen.fingerprint.digest.equals(A.digest), 'to another request, the first delivery\'s marker stands')
      t.equal(await pf.lookup(request), null, 'the request\'s own lookup: a miss (it never waits on itself)')
      t.ok(await client.pttl(recordKey(prefix, request)) <= pttl, 'its ttl still runs from when it was written')
    })

    t.test('markInFlight writes the request\'s token: its later lookupOrMark knows the marker', async (t) => {
      const request = id('marked')
      await pf.markInFlight(request, A, LONG)
      const token = await owner('marked')
      t.ok(token !== null)
      t.same(await lookupOrMark(request, A, LONG), { hit: null, marked: true })
      await pf.markInFlight(request, A, LONG)
      t.equal(await owner('marked'), token, 'one request, one token')
    })

    t.test('another request\'s marker is a hit, and stays when this request clears', async (t) => {
      const first = id('foreign')
      const second = id('foreign')
      t.same(await lookupOrMark(first, A, LONG), { hit: null, marked: true })
      const token = await owner('foreign')
      t.ok(token !== null, 'the first request\'s marker')
      const looked = await lookupOrMark(second, A, LONG)
      t.equal(looked.marked, false, 'nothing written over it')
      t.ok(looked.hit?.state === 'in_progress' && looked.hit.fingerprint.digest.equals(A.digest), 'the other request in flight')
      t.equal((await pf.lookup(second))?.state, 'in_progress', 'to its plain lookup too')
      t.same(await marker('foreign'), ['in_progress', token])
      await pf.clearInFlight(second) // it holds a token (its lookupOrMark drew one), not this marker's
      t.same(await marker('foreign'), ['in_progress', token], 'the first request\'s marker stays')
      await pf.markInFlight(second, A, 1) // the store handed it the key: its marker replaces the first's...
      await sleep(10) // ...and expires
      t.equal(await client.exists(recordKey(prefix, first)), 0)
      await pf.markInFlight(first, A, LONG)
      await pf.clearInFlight(second)
      t.same(await marker('foreign'), ['in_progress', token], 'a request whose marker expired leaves the one there now')
      await pf.clearInFlight(first)
      t.equal(await client.exists(recordKey(prefix, first)), 0, 'its owner clears it')
    })

    t.test('a request the store hands the key to marks over another request\'s marker, which then is its own', async (t) => {
      const stale = id('takeover')
      const taker = id('takeover')
      await pf.markInFlight(stale, A, LONG)
      await pf.markInFlight(taker, A, LONG)
      t.same(await lookupOrMark(taker, A, LONG), { hit: null, marked: true }, 'the new owner\'s')
      await pf.clearInFlight(stale)
      t.equal((await pf.lookup(id('takeover')))?.state, 'in_progress', 'the former owner cannot clear it')
      await pf.clearInFlight(taker)
      t.equal(await pf.lookup(id('takeover')), null)
    })

    t.test('a marker without an owner (an earlier version\'s) is another request\'s', async (t) => {
      const key = recordKey(prefix, id('legacy'))
      await client.hset(key, 'state', 'in_progress', 'alg', A.algorithm, 'digest', A.digest)
      await client.pexpire(key, LONG)
      const request = id('legacy')
      const looked = await lookupOrMark(request, A, LONG)
      t.equal(looked.marked, false, 'not taken for the caller\'s')
      t.equal(looked.hit?.state, 'in_progress', 'a request in flight')
      await pf.clearInFlight(request) // the request holds a token, which is not the marker's
      const left = await client.hgetallBuffer(key)
      t.same(Object.keys(left).sort(), ['alg', 'digest', 'state'], 'left alone: still without an owner')
      t.ok(left.state?.toString() === 'in_progress' && left.digest?.equals(A.digest), 'and still the same marker')
      t.ok(await client.pttl(key) > 0, 'its ttl ends it')
    })

    t.test('a completed copy is left alone by a clear, whoever clears', async (t) => {
      const request = id('completed')
      t.same(await lookupOrMark(request, A, LONG), { hit: null, marked: true })
      await pf.remember(id('completed'), A, RESPONSE, LONG) // another request's copy replaces the marker
      await pf.clearInFlight(request)
      const hit = await pf.lookup(id('completed'))
      t.ok(hit?.state === 'completed' && hit.response.body?.equals(binary), 'still replays')
      t.equal(await owner('completed'), null, 'a copy names no owner')
      const looked = await lookupOrMark(request, A, LONG)
      t.ok(looked.hit?.state === 'completed' && !looked.marked, 'and is what the request\'s next look finds')
    })

    t.test('remember replaces any marker, its own or another request\'s', async (t) => {
      for (const [key, writer] of [['mine', id('mine')], ['theirs', id('theirs')]] as const) {
        await pf.markInFlight(writer, A, LONG)
        await pf.remember(key === 'mine' ? writer : id(key), A, RESPONSE, LONG)
        t.equal((await pf.lookup(id(key)))?.state, 'completed', key)
      }
    })
  })

  t.test('TTLs bound the marker and the record, which then disappear', async (t) => {
    const { pf, prefix } = make()
    await pf.markInFlight(id('marker'), A, 80)
    await pf.remember(id('record'), A, RESPONSE, 80)
    for (const key of ['marker', 'record']) {
      const pttl = await client.pttl(recordKey(prefix, id(key)))
      t.ok(pttl > 0 && pttl <= 80, `${key}: PTTL ${pttl} within (0, 80]`)
    }
    // remember replacing a long marker takes the record's (shorter) ttl
    await pf.markInFlight(id('replaced'), A, LONG)
    await pf.remember(id('replaced'), A, RESPONSE, 80)
    const pttl = await client.pttl(recordKey(prefix, id('replaced')))
    t.ok(pttl > 0 && pttl <= 80, `replaced: PTTL ${pttl} within (0, 80]`)
    await sleep(150)
    for (const key of ['marker', 'record', 'replaced']) {
      t.equal(await pf.lookup(id(key)), null, `${key} expired`)
      t.equal(await client.exists(recordKey(prefix, id(key))), 0, `${key} gone from Redis`)
    }
    // a ttl of 0 or less writes nothing (a copy must not outlive its original)
    await pf.remember(id('zero'), A, RESPONSE, 0)
    await pf.markInFlight(id('zero'), A, -5)
    t.equal(await pf.lookup(id('zero')), null)
  })

  t.test('scopes and keys are isolated, whatever their characters', async (t) => {
    const { pf } = make()
    const ids: RecordId[] = [
      { scope: 'a', key: 'b:c' }, { scope: 'a:b', key: 'c' }, { scope: '', key: 'ab' }, { scope: 'ab', key: '' },
      { scope: 'a', key: 'b' }, { scope: '1:a', key: 'b' }, { scope: 'a"', key: "'b" }, { scope: 'a', key: '"\'b' },
      { scope: '{x}', key: '{y}' }, { scope: '{x}{', key: 'y}' }, { scope: '}', key: '{' },
      { scope: 'é', key: 'ü🙂' }, { scope: 'e\u0301', key: 'ü🙂' }, { scope: '\ud800', key: 'x' }, { scope: '\ud801', key: 'x' },
      { scope: ']]--', key: "'); redis.call('FLUSHALL') --" }, { scope: '%s\0*?[', key: '\r\n*1\r\n$4\r\nPING\r\n' }
    ]
    for (const [index, record] of ids.entries()) {
      await pf.remember(record, A, { statusCode: 200, headers: {}, body: Buffer.from(`body ${index}`) }, LONG)
    }
    for (const [index, record] of ids.entries()) {
      const hit = await pf.lookup(record)
      t.equal(hit?.state === 'completed' ? hit.response.body?.toString() : undefined, `body ${index}`, JSON.stringify(record))
    }
    // another prefix sees none of it
    t.equal(await make().pf.lookup(ids[0]!), null)
  })

  t.test('two prefilters on one client define the scripts once', async (t) => {
    const prefix = newPrefix()
    const first = redisPrefilter({ client, prefix })
    const original = client.defineCommand
    let calls = 0
    client.defineCommand = function (this: unknown, name: string, definition: { lua: string, numberOfKeys?: number }) {
      calls++
      original.call(client, name, definition)
    } as typeof client.defineCommand
    try {
      const second = redisPrefilter({ client, prefix, timeout: 2000 })
      t.equal(calls, 0)
      await second.markInFlight({ scope: 's', key: 'k' }, A, LONG)
      t.equal((await first.lookup({ scope: 's', key: 'k' }))?.state, 'in_progress')
      await first.close()
      await second.close()
    } finally {
      client.defineCommand = original
    }
  })

  t.test('close() resolves, leaves the client alone, and later calls reject', async (t) => {
    const { pf } = make()
    await pf.close()
    await t.rejects(pf.lookup(id('k')), { code: 'FST_IDEMPOTENCY_PREFILTER_CLOSED' })
    await t.rejects(pf.clearInFlight(id('k')), { code: 'FST_IDEMPOTENCY_PREFILTER_CLOSED' }, 'a clear too, with or without a marker of its own')
    t.equal(await client.ping(), 'PONG')
  })
}

function standaloneOnly (t: Test, client: Redis): void {
  t.test('a flushed Redis loses everything: lookups miss', async (t) => {
    const pf = redisPrefilter({ client, prefix: newPrefix(), timeout: 2000 })
    await pf.remember({ scope: 's', key: 'k' }, A, RESPONSE, LONG)
    await client.flushdb() // this file's own database (FLUSHALL would hit the files running beside it)
    t.equal(await pf.lookup({ scope: 's', key: 'k' }), null)
    // and the scripts still run (ioredis falls back to EVAL if the script cache went too)
    await client.script('FLUSH')
    await pf.markInFlight({ scope: 's', key: 'k' }, A, LONG)
    t.equal((await pf.lookup({ scope: 's', key: 'k' }))?.state, 'in_progress')
  })

  /**
   * A client of its own, so that its socket carries one test's commands only: its writes and the
   * pipelines made on it are counted.
   */
  async function countedClient (t: Test): Promise<{ client: Redis, writes: () => number, pipelines: () => number }> {
    const own = new Redis(REDIS_URL, { db: 1 })
    t.teardown(() => own.disconnect())
    await own.ping()
    let writes = 0
    let pipelines = 0
    const stream = (own as unknown as { stream: Socket }).stream
    const write = stream.write
    stream.write = function (this: Socket, ...args: unknown[]): boolean {
      writes++
      return (write as (...args: unknown[]) => boolean).apply(this, args)
    } as typeof stream.write
    const pipeline = own.pipeline.bind(own)
    own.pipeline = (...args: Parameters<Redis['pipeline']>) => { pipelines++; return pipeline(...args) }
    return { client: own, writes: () => writes, pipelines: () => pipelines }
  }

  t.test('the operations of one event-loop turn share one pipeline: one write, each its own answer or error', async (t) => {
    const { client: own, writes } = await countedClient(t)
    const prefix = newPrefix()
    const pf = redisPrefilter({ client: own, prefix, timeout: 2000 })
    const lookupOrMark = pf.lookupOrMark as NonNullable<IdempotencyPrefilter['lookupOrMark']>
    const record = (i: number): RecordId => ({ scope: 's', key: `k${i}` })
    const body = (i: number): Buffer => Buffer.from(`body ${i}`)

    await Promise.all(Array.from({ length: 10 }, (_, i) => pf.remember(record(i), A, { ...RESPONSE, body: body(i) }, LONG)))
    t.equal(writes(), 1, '10 copies written in one turn: one write')

    // Not a hash: its script fails (WRONGTYPE), and only its caller sees that.
    await client.set(recordKey(prefix, record(99)), 'not a hash')
    const before = writes()
    const marking = [...Array.from({ length: 20 }, (_, i) => lookupOrMark(record(i), A, LONG)), lookupOrMark(record(99), A, LONG)]
    const looking = pf.lookup(record(3))
    const answers = await Promise.allSettled(marking)
    const plain = await looking
    t.equal(writes() - before, 1, '22 operations in one turn: one write')
    for (let i = 0; i < 20; i++) {
      const answer = answers[i]!
      if (answer.status !== 'fulfilled') {
        t.fail(`k${i}: rejected (${String(answer.reason)})`)
        continue
      }
      if (i < 10) {
        const hit = answer.value.hit
        t.ok(hit?.state === 'completed' && hit.response.body?.equals(body(i)) === true && !answer.value.marked, `k${i}: its own copy`)
      } else {
        t.same(answer.value, { hit: null, marked: true }, `k${i}: a miss, marked`)
      }
    }
    t.equal(answers[20]!.status, 'rejected', 'the failing command rejects')
    t.match(answers[20]!.status === 'rejected' ? String(answers[20]!.reason) : '', /WRONGTYPE/)
    t.ok(plain?.state === 'completed' && plain.response.body?.equals(body(3)), 'a plain lookup in the same pipeline: its own answer')
    t.equal((await pf.lookup(record(15)))?.state, 'in_progress', 'the markers were written')
    t.equal(pf.stats.failures, 1)
  })

  t.test('a command that throws as it is queued fails alone, in its caller, with or without company in its turn', async (t) => {
    const { client: own, writes } = await countedClient(t)
    const enqueue = pipelining(own, true)
    const send = <T>(command: Parameters<typeof enqueue<T>>[0]): Promise<T> => new Promise<T>((resolve, reject) => {
      enqueue<T>(command, (error, reply) => { if (error !== null && error !== undefined) reject(error); else resolve(reply as T) })
    })
    const refused = (): never => { throw new TypeError('refused argument') }
    await t.rejects(send(refused), { message: 'refused argument' }, 'alone in its turn')
    const key = `${newPrefix()}:k`
    await own.set(key, 'v')
    const before = writes()
    const [first, thrown, last] = await Promise.allSettled([
      send<Buffer | null>((redis, done) => (redis as unknown as Redis).getBuffer(key, done as Callback<Buffer | null>)),
      send(refused),
      send<Buffer | null>((redis, done) => (redis as unknown as Redis).getBuffer(key, done as Callback<Buffer | null>))
    ])
    t.equal(writes() - before, 1, 'the two others still share one write')
    t.ok(first.status === 'fulfilled' && first.value?.toString() === 'v', 'the command before it: its own reply')
    t.ok(thrown.status === 'rejected' && (thrown.reason as Error).message === 'refused argument', 'it rejects')
    t.ok(last.status === 'fulfilled' && last.value?.toString() === 'v', 'the command after it: its own reply')
  })

  t.test('a lone operation in its turn goes out on the client, without a pipeline; two share one', async (t) => {
    const { client: own, writes, pipelines } = await countedClient(t)
    const pf = redisPrefilter({ client: own, prefix: newPrefix(), timeout: 2000 })
    await pf.remember({ scope: 's', key: 'k' }, A, RESPONSE, LONG)
    t.equal((await pf.lookup({ scope: 's', key: 'k' }))?.state, 'completed')
    t.same([writes(), pipelines()], [2, 0], 'two turns of one operation: two writes, no pipeline')
    const [one, two] = await Promise.all([pf.lookup({ scope: 's', key: 'k' }), pf.lookup({ scope: 's', key: 'absent' })])
    t.same([one?.state, two], ['completed', null])
    t.same([writes(), pipelines()], [3, 1], 'one turn of two operations: one pipeline, one write')
  })

  t.test('a pipeline that fails as a whole fails each of its commands, which fall through', async (t) => {
    const { client: own } = await countedClient(t)
    // A pipeline whose exec fails before anything is sent (as ioredis's does when a cluster has no
    // slots yet): no command of it is ever answered on its own.
    own.pipeline = () => ({ hgetallBuffer: () => {}, exec: async () => { throw new Error('pipeline lost') } }) as unknown as ReturnType<Redis['pipeline']>
    const pf = redisPrefilter({ client: own, prefix: newPrefix(), timeout: 2000 })
    const started = Date.now()
    const answers = await Promise.allSettled([pf.lookup({ scope: 's', key: 'a' }), pf.lookup({ scope: 's', key: 'b' })])
    t.same(answers.map((answer) => answer.status === 'rejected' ? (answer.reason as Error).message : answer.status), ['pipeline lost', 'pipeline lost'])
    t.ok(Date.now() - started < 1000, 'at once, not at the 2 s deadline')
    t.equal(pf.stats.failures, 2)
  })

  t.test('pipeline: false sends each operation on its own, with the same answers', async (t) => {
    const { client: own, writes } = await countedClient(t)
    const pf = redisPrefilter({ client: own, prefix: newPrefix(), timeout: 2000, pipeline: false })
    const record = (i: number): RecordId => ({ scope: 's', key: `k${i}` })
    await Promise.all(Array.from({ length: 5 }, (_, i) => pf.remember(record(i), A, RESPONSE, LONG)))
    const before = writes()
    const hits = await Promise.all(Array.from({ length: 10 }, (_, i) => pf.lookup(record(i))))
    t.equal(writes() - before, 10, 'one write per operation')
    t.same(hits.map((hit) => hit?.state ?? null), [...Array(5).fill('completed'), ...Array(5).fill(null)])
  })

  /** A client of its own behind a delaying proxy, connected before any delay is set. */
  async function slowClient (t: Test): Promise<{ proxy: Awaited<ReturnType<typeof delayingProxy>>, slow: Redis }> {
    const proxy = await delayingProxy(client.options.port ?? 6379, client.options.host ?? '127.0.0.1')
    const slow = new Redis({ host: '127.0.0.1', port: proxy.port, maxRetriesPerRequest: 0, retryStrategy: () => null })
    slow.on('error', () => {})
    t.teardown(async () => {
      slow.disconnect()
      await proxy.close()
    })
    await slow.ping()
    return { proxy, slow }
  }

  t.test('a Redis slower than timeout: every operation rejects in about timeout ms', async (t) => {
    const { proxy, slow } = await slowClient(t)
    const pf = redisPrefilter({ client: slow, prefix: newPrefix(), timeout: 50 })
    proxy.delay = 300
    const request: RecordId = { scope: 's', key: 'k' } // marks, so that its clear is sent
    const operations: Array<[string, () => Promise<unknown>]> = [
      ['lookup', () => pf.lookup(request)],
      ['markInFlight', () => pf.markInFlight(request, A, LONG)],
      ['clearInFlight', () => pf.clearInFlight(request)],
      ['remember', () => pf.remember(request, A, RESPONSE, LONG)]
    ]
    for (const [name, run] of operations) {
      const started = Date.now()
      await t.rejects(run(), { code: 'FST_IDEMPOTENCY_PREFILTER_TIMEOUT' }, name)
      const elapsed = Date.now() - started
      t.ok(elapsed >= 45 && elapsed < 200, `${name} rejected after ${elapsed} ms`)
    }
    // a late failure (the connection dies before the slow replies arrive) stays handled too
    const late = pf.lookup({ scope: 's', key: 'late' })
    await t.rejects(late, { code: 'FST_IDEMPOTENCY_PREFILTER_TIMEOUT' })
    proxy.destroyAll()
  })

  t.test('close() settles the operations still waiting at once, and their late replies are dropped', async (t) => {
    const { proxy, slow } = await slowClient(t)
    const pf = redisPrefilter({ client: slow, prefix: newPrefix(), timeout: 2000 })
    proxy.delay = 200
    const waiting = [pf.lookup({ scope: 's', key: 'a' }), pf.remember({ scope: 's', key: 'b' }, A, RESPONSE, LONG)]
    await sleep(20) // sent, not answered
    const started = Date.now()
    await pf.close()
    const answers = await Promise.allSettled(waiting)
    t.ok(Date.now() - started < 100, `settled ${Date.now() - started} ms after close(), not at the deadline`)
    t.same(answers.map((answer) => answer.status === 'rejected' ? (answer.reason as { code?: string }).code : answer.status),
      ['FST_IDEMPOTENCY_PREFILTER_CLOSED', 'FST_IDEMPOTENCY_PREFILTER_CLOSED'])
    t.equal(pf.stats.failures, 2)
    await sleep(300) // the replies arrive: nothing settles twice, nothing is counted twice
    t.equal(pf.stats.failures, 2)
  })

  t.test('operations waiting together share one deadline timer, however many they are', async (t) => {
    const { client: own } = await countedClient(t)
    const pf = redisPrefilter({ client: own, prefix: newPrefix(), timeout: 2000 })
    const original = globalThis.setTimeout
    let timers = 0
    globalThis.setTimeout = ((...args: Parameters<typeof setTimeout>) => { timers++; return original(...args) }) as typeof setTimeout
    let hits: Array<unknown>
    try {
      hits = await Promise.all(Array.from({ length: 20 }, (_, i) => pf.lookup({ scope: 's', key: `k${i}` })))
    } finally {
      globalThis.setTimeout = original
    }
    t.same(hits, Array(20).fill(null))
    t.ok(timers <= 1, `${timers} timer(s) armed for 20 operations`)
  })

  t.test('a stopped Redis: operations reject quickly', async (t) => {
    const port = await closedPort()
    const dead = new Redis({ host: '127.0.0.1', port, maxRetriesPerRequest: 0, enableOfflineQueue: false, retryStrategy: () => null, lazyConnect: true })
    dead.on('error', () => {})
    t.teardown(() => dead.disconnect())
    await dead.connect().catch(() => {})
    const pf = redisPrefilter({ client: dead, prefix: newPrefix(), timeout: 1000 })
    const request: RecordId = { scope: 's', key: 'k' } // marks, so that its clear is sent
    const runs: Array<() => Promise<unknown>> = [
      () => pf.lookup(request),
      () => pf.markInFlight(request, A, LONG),
      () => pf.clearInFlight(request),
      () => pf.remember(request, A, RESPONSE, LONG)
    ]
    for (const run of runs) {
      const started = Date.now()
      await t.rejects(run())
      t.ok(Date.now() - started < 100, `rejected after ${Date.now() - started} ms`)
    }
  })
}

function clusterOnly (t: Test, cluster: Cluster): void {
  t.test('keys spread over several masters, and every operation works', async (t) => {
    const prefix = newPrefix()
    const pf = redisPrefilter({ client: cluster, prefix, timeout: 2000 })
    const masters = cluster.nodes('master')
    t.ok(masters.length >= 3, `${masters.length} masters`)
    const used = new Set<string>()
    for (let i = 0; i < 30; i++) {
      const record = { scope: `tenant-${i % 3}`, key: `key-${i}` }
      await pf.markInFlight(record, A, LONG)
      t.equal((await pf.lookup({ ...record }))?.state, 'in_progress', 'another request sees the marker')
      await pf.clearInFlight(record)
      await pf.markInFlight(record, A, LONG)
      await pf.remember(record, A, RESPONSE, LONG)
      const hit = await pf.lookup(record)
      t.ok(hit?.state === 'completed' && hit.response.body?.equals(binary), `record ${i} replays`)
      for (const master of masters) {
        // a master that does not own the slot answers MOVED: the record is elsewhere
        if (await master.exists(recordKey(prefix, record)).catch(() => 0) === 1) used.add(`${master.options.host}:${master.options.port}`)
      }
    }
    t.ok(used.size >= 2, `records live on ${used.size} masters`)
  })
}

function optionTests (t: Test, client: Redis): void {
  const invalid: Array<[string, unknown]> = [
    ['client', {}], ['client', null], ['prefix', ''], ['prefix', 'a{b'], ['prefix', 'a}'], ['prefix', 3],
    ['timeout', 0], ['timeout', 1.5], ['timeout', '50'], ['timeout', Infinity], ['pipeline', 'false'], ['pipeline', 1], ['pipeline', null]
  ]
  for (const [option, value] of invalid) {
    const options = { client, [option]: value } as unknown as Parameters<typeof redisPrefilter>[0]
    t.throws(() => redisPrefilter(options), InvalidOptionError, `${option}: ${String(value)}`)
    try {
      redisPrefilter(options)
    } catch (error) {
      t.match((error as Error).message, option, `the message names ${option}`)
    }
  }
  t.throws(() => redisPrefilter(undefined as unknown as Parameters<typeof redisPrefilter>[0]), InvalidOptionError)
}

/** A TCP proxy in front of Redis that holds every reply for `delay` ms. */
async function delayingProxy (targetPort: number, targetHost: string): Promise<{
  port: number, delay: number, destroyAll: () => void, close: () => Promise<void>
}> {
  const sockets = new Set<Socket>()
  const state = { delay: 0 }
  const server: Server = createServer((inbound) => {
    const outbound = connect(targetPort, targetHost)
    sockets.add(inbound).add(outbound)
    inbound.on('error', () => {})
    outbound.on('error', () => {})
    inbound.pipe(outbound)
    outbound.on('data', (chunk: Buffer) => {
      if (state.delay === 0) inbound.write(chunk)
      else setTimeout(() => { if (!inbound.destroyed) inbound.write(chunk) }, state.delay)
    })
    inbound.on('close', () => outbound.destroy())
    outbound.on('close', () => inbound.destroy())
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  return {
    port: (server.address() as AddressInfo).port,
    get delay () { return state.delay },
    set delay (ms: number) { state.delay = ms },
    destroyAll () { for (const socket of sockets) socket.destroy() },
    close: async () => {
      for (const socket of sockets) socket.destroy()
      await new Promise<void>((resolve) => server.close(() => resolve()))
    }
  }
}

/** A loopback port nothing listens on. */
async function closedPort (): Promise<number> {
  const server = createServer()
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as AddressInfo
  await new Promise<void>((resolve) => server.close(() => resolve()))
  return port
}
