import type { FastifyInstance, FastifyPluginCallback, RouteOptions } from 'fastify'
import { kState } from './request-state.js'
import { checkEarlierRoutes } from './earlier-routes.js'
import { checkPrefilter, checkStore, checkTransactions } from '../core/check-store.js'
import { closeEngine, createEngine } from '../core/engine.js'
import type { HttpEngine } from '../http/engine.js'
import { createRecordHook, routeHooks, trackHandler } from './hooks.js'
import { documentRoute } from '../http/openapi.js'
import { resolveGlobalOptions, resolveRouteConfig, type GlobalSettings, type IdempotencyOptions, type RouteSettings } from '../http/options.js'
import { buildProblemBodies } from '../http/problems.js'
import { registerStatusRoute } from '../http/status-route.js'
import { checkStoreWhenReady } from './store-check.js'
import { isMemoryStore, memoryStore } from '../../drivers/memory.js'
import { warnAboutDeployment } from './warnings.js'
import { createRunner } from '../jobs/runner.js'
import type { CoreSettings } from '../core/settings.js'

export const idempotencyPlugin: FastifyPluginCallback<IdempotencyOptions> = function fastifyIdempotency (fastify, options, done) {
  let global: GlobalSettings
  try {
    global = resolveGlobalOptions(options)
    if (options.store !== undefined) checkStore(options.store)
    if (options.prefilter !== undefined) checkPrefilter(options.prefilter)
    if (global.route.transaction) checkTransactions(options.store, 'option "transaction"')
  } catch (err) {
    // Through done(), so register() / ready() reject with it (a synchronous throw escapes avvio).
    done(err as Error)
    return
  }
  const ownsStore = options.store === undefined
  const store = options.store ?? memoryStore()

  const problemOptions = { typeBase: global.problemTypeBase, docsUrl: global.docsUrl, profile: global.profile }
  const engine: HttpEngine = {
    ...createEngine(store, options.prefilter ?? null, global.encryption, global.metrics),
    problems: buildProblemBodies(problemOptions),
    problemOptions
  }

  warnAboutDeployment(fastify, global.route.scope === null, ownsStore || isMemoryStore(store))
  checkEarlierRoutes(fastify, global.methods, global.onEarlierRoutes)
  checkStoreWhenReady(fastify, store, global.route.storeTimeout)
  fastify.decorate('idempotency', createRunner(engine, jobSettings(global.route), global.route.retryAfter * 1000, fastify.log))
  fastify.decorateRequest('idempotency', null)
  fastify.decorateRequest(kState, null)
  fastify.addHook('onRoute', function (route) { protectRoute(engine, global, route, this) })
  fastify.addHook('onSend', createRecordHook(engine))
  if (global.statusRoute !== null) {
    try {
      registerStatusRoute(fastify, engine, global, global.statusRoute)
    } catch (err) {
      // A path the router refuses, or one the app already declared: the registration fails, like a bad option.
      if (ownsStore) store.close().catch(() => {})
      done(err as Error)
      return
    }
  }
  fastify.addHook('onClose', async () => {
    closeEngine(engine)
    if (ownsStore) await store.close()
  })
  done()
}

/** Decides, once per route, whether and how it is protected, and attaches the hooks only to it. */
function protectRoute (engine: HttpEngine, global: GlobalSettings, route: RouteOptions, instance: FastifyInstance): void {
  const declared = (Array.isArray(route.method) ? route.method : [route.method]).map((m) => m.toUpperCase())
  const config: unknown = (route.config as { idempotency?: unknown } | undefined)?.idempotency
  let settings: RouteSettings | null
  let methods: ReadonlySet<string> | null = null
  if (config === undefined) {
    const covered = declared.filter((method) => global.methods.has(method))
    if (covered.length === 0) return
    settings = global.route
    if (covered.length < declared.length) methods = new Set(covered)
  } else {
    const where = `route ${declared.join(',')} ${route.url}`
    settings = resolveRouteConfig(global, config, where)
    if (settings === null) return
    if (settings.transaction) checkTransactions(engine.store, `${where} config.idempotency.transaction`)
  }

  if (global.openapi === true || (global.openapi === 'auto' && instance.hasDecorator('swagger'))) documentRoute(route, engine, global, settings, methods)
  const hooks = routeHooks(engine, settings, methods)
  appendHook(route, 'onRequest', hooks.onRequest)
  if (hooks.preParsing !== null) appendHook(route, 'preParsing', hooks.preParsing)
  appendHook(route, 'preHandler', hooks.preHandler)
  appendHook(route, 'onError', hooks.onError)
  appendHook(route, 'onResponse', hooks.onResponse)
  if (hooks.onTimeout !== null) appendHook(route, 'onTimeout', hooks.onTimeout)
  route.handler = trackHandler(route.handler)
}

type HookName = 'onRequest' | 'preParsing' | 'preHandler' | 'onError' | 'onResponse' | 'onTimeout'

/** Route-level hooks run after the instance's (auth, rate limits), so those answer first and are never recorded. */
function appendHook (route: RouteOptions, name: HookName, hook: unknown): void {
  const existing = route[name] as unknown
  const list: unknown[] = existing === undefined || existing === null ? [] : Array.isArray(existing) ? [...existing] : [existing]
  list.push(hook)
  ;(route as unknown as Record<HookName, unknown>)[name] = list
}

/** `fastify.idempotency.run()`'s defaults: the registration's, except that a job is never run unprotected. */
function jobSettings (route: RouteSettings): CoreSettings {
  const { ttl, lease, maxOwnership, wait, storeTimeout, retryAfter, transaction } = route
  return Object.freeze({ ttl, lease, maxOwnership, wait, storeTimeout, retryAfter, transaction, onStoreError: 'fail' })
}
