import { AsyncLocalStorage } from 'node:async_hooks'
import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify'
import idempotency, { idempotencyRunner, type IdempotencyRunner, type RouteIdempotencyOptions, type RunOptions } from '../../lib/index.js'
import type { IdempotencyPrefilter } from '../../lib/core/prefilter.js'
import type { IdempotencyStore } from '../../lib/core/store.js'
import type { JOB_ROUTES, Route, ROUTES } from './workload.js'

/*
 * The simulated instances: real Fastify apps with the real plugin, built once per process and
 * reused by every run. Each reaches the run's store (and, for the first two, the run's pre-filter)
 * through a forwarder, so a run swaps in fresh models without building apps again. Requests carry
 * their plan's number in `x-sim`; the run answers what the handler does (run.ts).
 */

export const LEASE = 300

/** What each route is: plugin options and Fastify's own handlerTimeout. */
const ROUTE_OPTIONS: Readonly<Record<typeof ROUTES[number], { readonly idempotency: RouteIdempotencyOptions, readonly handlerTimeout?: number }>> = {
  '/l/plain': { idempotency: { storeTimeout: 60 } },
  '/l/wait': { idempotency: { storeTimeout: 60, wait: 250 } },
  // storeTimeout past the handlerTimeout: an answer may go out while the claim is in flight.
  '/l/timeout': { idempotency: { storeTimeout: 400 }, handlerTimeout: 90 },
  '/l/rule': { idempotency: { storeTimeout: 60, record: () => { throw new Error('sim: the record rule has a bug') } } },
  // storeTimeout past the lease: a claim may be answered after one lease (given back, 503).
  '/l/slow': { idempotency: { storeTimeout: 500 } },
  '/l/steps': { idempotency: { storeTimeout: 60 } },
  '/a/plain': { idempotency: { storeTimeout: 60, transaction: true } },
  '/a/wait': { idempotency: { storeTimeout: 60, transaction: true, wait: 150 } },
  '/a/timeout': { idempotency: { storeTimeout: 400, transaction: true }, handlerTimeout: 90 }
}

type JobRoute = typeof JOB_ROUTES[number]

/**
 * The job door's routes: which runner runs them (the instance's `fastify.idempotency`, whose
 * storeTimeout is the registration's; a runner of its own with the routes' storeTimeout; one whose
 * storeTimeout is past the lease) and the run's own options.
 */
export const JOB_OPTIONS: Readonly<Record<JobRoute, { readonly runner: 'app' | 'own' | 'slow', readonly run: Partial<RunOptions> }>> = {
  '/j/app': { runner: 'app', run: {} },
  '/j/wait': { runner: 'own', run: { wait: 250 } },
  '/j/steps': { runner: 'own', run: {} },
  '/j/slow': { runner: 'slow', run: {} },
  '/ja/plain': { runner: 'own', run: { transaction: true } },
  '/ja/wait': { runner: 'own', run: { transaction: true, wait: 150 } }
}

/** An instance: its Fastify app and its job runners. */
export interface Instance {
  readonly app: FastifyInstance
  readonly runners: Readonly<Record<'app' | 'own' | 'slow', IdempotencyRunner>>
}

export interface Handlers {
  /** onRequest, before the plugin's own. */
  arrived (request: FastifyRequest): void
  handle (request: FastifyRequest, reply: FastifyReply, route: Route): Promise<unknown>
  /** A job's function, on the job door. */
  job (id: number, route: Route, op: Parameters<Parameters<IdempotencyRunner['run']>[1]>[0]): Promise<unknown>
  /** Fastify's onError, before the plugin's own (an instance hook runs before route hooks). */
  errored (request: FastifyRequest, error: Error & { code?: string }): void
}

export interface Current {
  store: IdempotencyStore
  prefilter: IdempotencyPrefilter
  handlers: Handlers
}

/** The simulated request a store or pre-filter call is made for: the async context of its inject. */
export const requestContext = new AsyncLocalStorage<number>()

export async function buildInstances (count: number, current: Current): Promise<Instance[]> {
  const store: IdempotencyStore = {
    claim: (request) => current.store.claim(request),
    claimInTransaction: (request) => (current.store.claimInTransaction as NonNullable<IdempotencyStore['claimInTransaction']>)(request),
    complete: (lease, response, ttl) => current.store.complete(lease, response, ttl),
    release: (lease) => current.store.release(lease),
    renew: (lease, ms) => current.store.renew(lease, ms),
    hold: (lease) => (current.store.hold as NonNullable<IdempotencyStore['hold']>)(lease),
    get: (id) => current.store.get(id),
    loadSteps: (lease) => (current.store.loadSteps as NonNullable<IdempotencyStore['loadSteps']>)(lease),
    saveStep: (lease, name, json) => (current.store.saveStep as NonNullable<IdempotencyStore['saveStep']>)(lease, name, json),
    purgeExpired: async () => 0,
    close: async () => {}
  }
  const prefilter: IdempotencyPrefilter = {
    lookup: (id) => current.prefilter.lookup(id),
    lookupOrMark: (id, fingerprint, ttl) => (current.prefilter.lookupOrMark as NonNullable<IdempotencyPrefilter['lookupOrMark']>)(id, fingerprint, ttl),
    markInFlight: (id, fingerprint, ttl) => current.prefilter.markInFlight(id, fingerprint, ttl),
    clearInFlight: (id) => current.prefilter.clearInFlight(id),
    remember: (id, fingerprint, response, ttl) => current.prefilter.remember(id, fingerprint, response, ttl),
    close: async () => {}
  }
  const instances: Instance[] = []
  for (let i = 0; i < count; i++) {
    const app = Fastify()
    // storeTimeout is the routes' (each sets its own) and what `fastify.idempotency.run()` gets.
    await app.register(idempotency, { store, ...(i < 2 ? { prefilter } : {}), scope: () => 'tenant', lease: LEASE, storeTimeout: 60 })
    app.addHook('onRequest', (request, _reply, done) => { current.handlers.arrived(request); done() })
    app.addHook('onError', (request, _reply, error, done) => { current.handlers.errored(request, error); done() })
    for (const [route, options] of Object.entries(ROUTE_OPTIONS) as Array<[typeof ROUTES[number], typeof ROUTE_OPTIONS[typeof ROUTES[number]]]>) {
      app.post(route, {
        config: { idempotency: options.idempotency },
        ...(options.handlerTimeout === undefined ? {} : { handlerTimeout: options.handlerTimeout })
      }, (request, reply) => current.handlers.handle(request, reply, route))
    }
    await app.ready()
    const shared = { store, ...(i < 2 ? { prefilter } : {}), lease: LEASE }
    instances.push({
      app,
      runners: {
        app: app.idempotency,
        own: idempotencyRunner({ ...shared, storeTimeout: 60 }),
        // storeTimeout past the lease: a claim may be answered after one lease (given back, an error).
        slow: idempotencyRunner({ ...shared, storeTimeout: 500 })
      }
    })
  }
  return instances
}
