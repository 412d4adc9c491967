import { createHash, randomBytes } from 'node:crypto'
import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest, type LightMyRequestResponse } from 'fastify'
import { Cluster, Redis } from 'ioredis'
import t, { type Test } from 'tap'
import idempotency, { memoryStore, type IdempotencyStore } from '../../lib/index.js'
import type { IdempotencyPrefilter } from '../../lib/core/prefilter.js'
import type { ClaimRequest, Fingerprint, RecordId } from '../../lib/core/store.js'
import { redisPrefilter } from '../../drivers/redis/index.js'
import { recordKey } from '../../drivers/redis/keys.js'
import { startReplyDropper, type ReplyDropper } from '../helpers/reply-dropping-proxy.js'
import { sleep } from '../helpers/sleep.js'
import { clusterNodes } from '../helpers/redis-nodes.js'

/**
 * A pre-filter command whose answer is lost runs on Redis anyway, and ioredis sends it again on its
 * next connection: the lookup-or-mark script's second delivery then finds the marker its first one
 * wrote. That marker is the request's own, and must read so (marked, no hit), not as another
 * request's original in flight; and a request clears its own marker only, never another's. Checked
 * on the driver, and through the plugin (memory store, this pre-filter): the request executes at
 * once and once, its retry replays. Against real servers, a standalone one (REDIS_URL) and a cluster
 * (REDIS_CLUSTER_NODES), each behind proxies that lose exactly that answer
 * (test/helpers/reply-dropping-proxy.ts); `node scripts/test.mjs test/redis/resend.test.ts`
 * provisions both.
 */

const REDIS_URL = process.env.REDIS_URL ?? ''
const CLUSTER_NODES = process.env.REDIS_CLUSTER_NODES ?? ''

const A: Fingerprint = { algorithm: 'canonical-v1', digest: createHash('sha256').update('request A').digest() }
const LONG = 60_000
const newPrefix = (): string => `idemtest-${randomBytes(6).toString('hex')}`

/** `promise`, or a rejection naming `what` after `ms`: a test that waits for something that never comes fails instead of hanging. */
async function within<T> (promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  try {
    return await Promise.race([promise, new Promise<never>((_resolve, reject) => {
      timer = setTimeout(() => reject(new Error(`${what}: not within ${ms} ms`)), ms)
    })])
  } finally {
    clearTimeout(timer)
  }
}

/** One kind of deployment: how to reach Redis directly, and through proxies that lose one answer. */
interface Deployment {
  /** A client that inspects what the pre-filter wrote, not behind the proxies. */
  readonly direct: Redis | Cluster
  /** A client whose every connection goes through `dropper`; ioredis's default reconnection. */
  readonly behind: (dropper: ReplyDropper) => Redis | Cluster
  readonly targets: ReadonlyArray<{ host: string, port: number }>
}

if (REDIS_URL === '' || CLUSTER_NODES === '') {
  t.fail('REDIS_URL and REDIS_CLUSTER_NODES must be set: run `node scripts/test.mjs test/redis/resend.test.ts` ' +
    '(it starts throwaway servers and sets both), or set REDIS_URL=redis://… and REDIS_CLUSTER_NODES=host:port,….')
} else {
  const url = new URL(REDIS_URL)
  const nodes = clusterNodes(CLUSTER_NODES)
  // A database of its own: test/redis/redis.test.ts flushes database 1 while the files beside it run.
  const standalone = new Redis(REDIS_URL, { db: 4 })
  const cluster = new Cluster(nodes)
  t.teardown(() => {
    standalone.disconnect()
    cluster.disconnect()
  })
  const deployments: Array<[string, Deployment]> = [
    ['standalone', {
      direct: standalone,
      targets: [{ host: url.hostname, port: Number(url.port || 6379) }],
      behind: (dropper) => new Redis({ host: '127.0.0.1', port: dropper.ports[0], db: 4 })
    }],
    ['cluster', {
      direct: cluster,
      targets: nodes,
      // Every node the cluster announces is reached through its proxy.
      behind: (dropper) => new Cluster(dropper.ports.map((port) => ({ host: '127.0.0.1', port })), { natMap: { ...dropper.natMap } })
    }]
  ]
  for (const [name, deployment] of deployments) {
    t.test(name, async (t) => {
      t.test('driver', async (t) => { await resentLookupOrMark(t, deployment) })
      t.test('through the plugin', async (t) => { await throughThePlugin(t, deployment) })
    })
  }
}

/** Proxies in front of the deployment, and a client behind them, both gone when `t` ends. */
async function behindDropper (t: Test, deployment: Deployment): Promise<{ dropper: ReplyDropper, client: Redis | Cluster }> {
  const dropper = await startReplyDropper(deployment.targets)
  const client = deployment.behind(dropper)
  client.on('error', () => {}) // the cut connections: ioredis reports each one
  t.teardown(async () => {
    client.disconnect()
    await dropper.close()
  })
  await client.ping()
  return { dropper, client }
}

async function resentLookupOrMark (t: Test, deployment: Deployment): Promise<void> {
  const { direct } = deployment
  const { dropper, client } = await behindDropper(t, deployment)
  const prefix = newPrefix()
  // Long enough for ioredis to reconnect and send the script again within one operation.
  const pf = redisPrefilter({ client, prefix, timeout: 5000 })
  const lookupOrMark = pf.lookupOrMark as NonNullable<IdempotencyPrefilter['lookupOrMark']>
  const request: RecordId = { scope: 'tenant', key: 'resent' }
  const key = recordKey(prefix, request)

  const cut = dropper.dropReplyTo(key)
  const looked = await lookupOrMark(request, A, LONG)
  await within(cut, 10_000, 'the answer is lost')
  t.equal(dropper.dropped, 1, 'the first delivery ran and its answer was lost: this answer is the second delivery\'s')
  t.same(looked, { hit: null, marked: true }, 'the second delivery finds the request\'s own marker: marked, and no hit')

  const marker = await direct.hgetall(key)
  t.equal(marker.state, 'in_progress', 'the marker is there')
  t.ok(typeof marker.owner === 'string' && marker.owner.length > 0, 'and names its owner')
  const pttl = await direct.pttl(key)
  t.ok(pttl > 0 && pttl <= LONG, `bounded by the lease (PTTL ${pttl})`)
  // The request's token is the one its markers carry: marking again writes the same.
  await pf.markInFlight(request, A, LONG)
  t.equal(await direct.hget(key, 'owner'), marker.owner, 'the owner is the request\'s token')

  const other = await lookupOrMark({ ...request }, A, LONG)
  t.equal(other.marked, false, 'another request writes nothing over it')
  t.equal(other.hit?.state, 'in_progress', 'and sees it as a request in flight')

  await pf.clearInFlight(request)
  t.equal(await direct.exists(key), 0, 'the request\'s clearInFlight removes it')
  t.equal(pf.stats.failures, 0, 'no operation failed: the lost answer was made good by the second delivery')
}

interface Gated extends IdempotencyStore {
  /** Claims made so far. */
  readonly claims: () => number
  /** Holds the next claim until the returned function is called; resolves when that claim arrives. */
  holdNextClaim (): Promise<() => void>
}

/** A memory store whose claims are counted, and one of which can be held. */
function gatedStore (): Gated {
  const inner = memoryStore({ purgeInterval: 0 })
  let claims = 0
  let hold: ((release: () => void) => void) | null = null
  return {
    ...inner,
    claims: () => claims,
    holdNextClaim: () => new Promise((resolve) => { hold = resolve }),
    claim: async (request: ClaimRequest) => {
      claims++
      const arrived = hold
      hold = null
      if (arrived !== null) await new Promise<void>((resolve) => { arrived(resolve) })
      return await inner.claim(request)
    }
  }
}

async function throughThePlugin (t: Test, deployment: Deployment): Promise<void> {
  const { direct } = deployment
  const { dropper, client } = await behindDropper(t, deployment)
  const prefix = newPrefix()
  const pf = redisPrefilter({ client, prefix, timeout: 5000 })
  /** The pre-filter's clears, as the plugin makes them (they are fire-and-forget there). */
  const clears: Array<Promise<void>> = []
  const prefilter: IdempotencyPrefilter = {
    lookup: async (id) => await pf.lookup(id),
    lookupOrMark: async (id, fingerprint, ttl) => await (pf.lookupOrMark as NonNullable<IdempotencyPrefilter['lookupOrMark']>)(id, fingerprint, ttl),
    markInFlight: async (id, fingerprint, ttl) => { await pf.markInFlight(id, fingerprint, ttl) },
    clearInFlight: async (id) => {
      const clear = pf.clearInFlight(id)
      clears.push(clear.catch(() => {}))
      await clear
    },
    remember: async (id, fingerprint, response, ttl) => { await pf.remember(id, fingerprint, response, ttl) },
    close: async () => { await pf.close() }
  }
  const store = gatedStore()
  const app: FastifyInstance = Fastify()
  t.teardown(() => app.close())
  await app.register(idempotency, { store, prefilter, scope: () => 'tenant' })
  const runs = new Map<string, number>()
  /** The handler of each key waits for its gate, when the test set one. */
  const gates = new Map<string, Promise<void>>()
  const handler = async (request: FastifyRequest, reply: FastifyReply): Promise<FastifyReply> => {
    const key = request.idempotency?.key ?? ''
    runs.set(key, (runs.get(key) ?? 0) + 1)
    await gates.get(key)
    return reply.code(201).send({ key, charge: randomBytes(6).toString('hex') })
  }
  // A 2 s lease: a request that took its own marker for another's would be refused, or kept
  // waiting, for up to that long. The second route makes duplicates wait for the original (up to
  // 3 s), the case in which the first look also marks the key.
  const WAIT = 3000
  app.post('/pay', { config: { idempotency: { lease: 2000 } } }, handler)
  app.post('/pay-waiting', { config: { idempotency: { lease: 2000, wait: WAIT } } }, handler)
  const pay = (key: string, route = '/pay'): Promise<LightMyRequestResponse> => app.inject({
    method: 'POST', url: route, headers: { 'idempotency-key': `"${key}"`, 'content-type': 'application/json' }, payload: { amount: 1 }
  })
  const id = (key: string): RecordId => ({ scope: 'tenant', key })
  /** Waits (bounded) for the fire-and-forget copy of a completed record into Redis. */
  async function copied (key: string): Promise<void> {
    for (let i = 0; i < 200 && (await pf.lookup(id(key)))?.state !== 'completed'; i++) await sleep(10)
  }

  for (const route of ['/pay', '/pay-waiting']) {
    t.test(`${route}: a fresh key whose first look's answer was lost executes at once, once, and a retry replays it`, async (t) => {
      const key = `fresh${route.replace('/', '-')}`
      const cut = dropper.dropReplyTo(recordKey(prefix, id(key)))
      const started = Date.now()
      const first = await pay(key, route)
      const elapsed = Date.now() - started
      await within(cut, 10_000, 'the answer is lost')
      t.equal(first.statusCode, 201, 'answered by its handler, not refused as its own duplicate')
      t.equal(first.headers['idempotent-replayed'], undefined)
      t.ok(elapsed < 1500, `without waiting on itself (${elapsed} ms; the lease is 2000, the wait ${route === '/pay' ? 0 : WAIT})`)
      t.equal(runs.get(key), 1)
      await copied(key)
      const claims = store.claims()
      const retry = await pay(key, route)
      t.equal(retry.statusCode, 201)
      t.equal(retry.headers['idempotent-replayed'], 'true', 'the retry is the replay')
      t.equal(retry.body, first.body)
      t.equal(store.claims(), claims, 'answered from the copy in Redis')
      t.equal(runs.get(key), 1, 'executed once')
    })
  }

  for (const lost of [false, true]) {
    t.test(`another request's marker is never cleared by this request${lost ? ', its first look\'s answer lost' : ''}`, async (t) => {
      const name = lost ? 'shared-lost' : 'shared'
      const key = recordKey(prefix, id(name))
      // The original runs, and holds the key in the store, until released.
      let finish = (): void => {}
      gates.set(name, new Promise<void>((resolve) => { finish = resolve }))
      const original = pay(name, '/pay-waiting')
      for (let i = 0; i < 500 && runs.get(name) !== 1; i++) await sleep(5)
      t.equal(runs.get(name), 1, 'the original runs')
      await direct.del(key) // its marker is lost (an eviction)

      // A duplicate: its first look finds nothing and marks (when its answer is lost, the second
      // delivery finds the duplicate's own marker). While its claim is held, that marker gives way
      // to another request's.
      const held = store.holdNextClaim()
      const dropped = dropper.dropped
      const cut = lost ? dropper.dropReplyTo(key) : Promise.resolve()
      const duplicate = pay(name, '/pay-waiting')
      const release = await within(held, 10_000, 'the duplicate\'s claim reaches the store')
      await within(cut, 10_000, 'the answer is lost')
      t.equal(dropper.dropped, dropped + (lost ? 1 : 0), lost ? 'the duplicate\'s answer was lost' : 'nothing lost')
      t.equal(await direct.hget(key, 'state'), 'in_progress', 'the duplicate\'s marker is there')
      const duplicateOwner = await direct.hget(key, 'owner')
      await direct.del(key)
      const another = id(name) // another request: a RecordId of its own
      await pf.markInFlight(another, A, LONG)
      const anotherOwner = await direct.hget(key, 'owner')
      t.ok(anotherOwner !== null && anotherOwner !== duplicateOwner, 'two requests, two tokens')
      const clearsBefore = clears.length
      release()

      // The store says the original is in progress: the duplicate clears its marker, and waits.
      for (let i = 0; i < 500 && clears.length === clearsBefore; i++) await sleep(5)
      t.equal(clears.length, clearsBefore + 1, 'the duplicate cleared its marker')
      await Promise.all(clears)
      t.same(await direct.hmget(key, 'state', 'owner'), ['in_progress', anotherOwner], 'the other request\'s marker stays')

      finish()
      const done = await original
      t.equal(done.statusCode, 201)
      const waited = await duplicate
      t.equal(waited.statusCode, 201, 'the duplicate waited for the original\'s answer')
      t.equal(waited.headers['idempotent-replayed'], 'true')
      t.equal(waited.body, done.body)
      await copied(name)
      const retry = await pay(name, '/pay-waiting')
      t.equal(retry.headers['idempotent-replayed'], 'true')
      t.equal(retry.body, done.body)
      t.equal(runs.get(name), 1, 'executed once')
    })
  }
}
