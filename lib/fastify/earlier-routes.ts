import type { FastifyInstance } from 'fastify'
import { UnprotectedRoutesError } from '../core/errors.js'
import type { EarlierRoutesPolicy } from '../http/options.js'
import { bootWarning, WARNING_CODES } from './warnings.js'

interface PrintedRoute {
  readonly route: string
  meta: string
}

/**
 * Fastify's onRoute only sees routes added after the plugin loaded, so a route declared before it
 * (`app.register(idempotency)` without `await`, then `app.post(...)`; or a routes plugin
 * registered first) runs unprotected. Each route for a protected method already in the router
 * when the plugin loads is such a route, unless it belongs to another context: the router is the
 * whole app's, and a registration inside an encapsulated context was never meant to protect its
 * siblings' routes. Which routes are this instance's (or its children's) is known once the app is
 * ready: Fastify has then bound to them the marker hook added here, as it binds every hook of an
 * instance to its own routes and its children's. By default the boot then fails, naming them.
 */
export function checkEarlierRoutes (fastify: FastifyInstance, methods: ReadonlySet<string>, policy: EarlierRoutesPolicy): void {
  const earlier = new Set(printedRoutes(fastify, methods, false).map((r) => r.route))
  if (earlier.size === 0) return
  fastify.addHook('onError', fastifyIdempotencyContext)
  fastify.addHook('onReady', async function checkEarlierRoutesWhenReady () {
    const mine = printedRoutes(fastify, methods, true).filter((r) => earlier.has(r.route) && r.meta.includes(MARKER)).map((r) => r.route)
    if (mine.length === 0) return
    if (policy === 'fail') throw new UnprotectedRoutesError(mine)
    bootWarning(fastify, WARNING_CODES.unprotectedRoutes, `fastify-idempotency: these routes were declared before the plugin finished registering and are NOT protected: ${mine.join('; ')}. ` +
      'Await app.register(idempotency, ...) before declaring routes, or declare them in a plugin registered after it.')
  })
}

/** Does nothing: its presence in a route's hooks says the route belongs to the plugin's instance. */
function fastifyIdempotencyContext (_request: unknown, _reply: unknown, _error: unknown, done: () => void): void { done() }
const MARKER = `${fastifyIdempotencyContext.name}()`

/**
 * The router's routes for protected methods, one `METHOD /path` each, with the onError hooks
 * Fastify bound to it (once ready). printRoutes is Fastify's only public view of every route: a
 * tree whose lines each hold the part of the path below their parent, four columns per level.
 */
function printedRoutes (fastify: FastifyInstance, methods: ReadonlySet<string>, withHooks: boolean): PrintedRoute[] {
  const found: PrintedRoute[] = []
  const labels: string[] = []
  let current: PrintedRoute[] = []
  const text = fastify.printRoutes(withHooks ? { commonPrefix: false, includeMeta: ['onError'] } : { commonPrefix: false })
  for (const line of text.split('\n')) {
    const at = line.indexOf('\u2500\u2500 ') // the `── ` of `├── ` and `└── `
    if (at < 0) {
      for (const route of current) route.meta += line // a meta line (`• (onError) [...]`) of the node above
      continue
    }
    const depth = (at - 1) / 4
    const node = /^(\S+)(?: \(([^)]+)\))?/.exec(line.slice(at + 3))
    if (node === null) continue
    labels.length = depth
    labels.push(node[1] ?? '')
    const path = labels.join('')
    current = (node[2] ?? '').split(',').map((m) => m.trim().toUpperCase()).filter((m) => methods.has(m))
      .map((method) => ({ route: `${method} ${path}`, meta: '' }))
    found.push(...current)
  }
  return found
}
