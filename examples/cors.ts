/**
 * Browser clients: the @fastify/cors setup the README documents (test/plugin/cors.test.ts runs this very
 * object against a listening server).
 *
 * `Idempotency-Key` is not a CORS-safelisted request header (Fetch standard,
 * #cors-safelisted-request-header), so a browser preflights every cross-origin request that sends
 * it; and only safelisted response headers are readable by page scripts unless they are listed in
 * `Access-Control-Expose-Headers` (#http-access-control-expose-headers).
 *
 *   npx tsx examples/cors.ts
 *   curl -i -X OPTIONS localhost:3000/payments -H 'Origin: https://app.example.com' \
 *        -H 'Access-Control-Request-Method: PATCH' -H 'Access-Control-Request-Headers: idempotency-key, content-type'
 */
import { pathToFileURL } from 'node:url'
import cors, { type FastifyCorsOptions } from '@fastify/cors'
import Fastify, { type FastifyInstance } from 'fastify'
import idempotency from '../lib/index.js'

export const corsOptions = {
  origin: ['https://app.example.com'],
  // @fastify/cors allows GET, HEAD and POST by default: PATCH (and PUT or DELETE routes opted in) must be listed.
  methods: ['GET', 'HEAD', 'POST', 'PATCH'],
  // content-type too: application/json is not safelisted either.
  allowedHeaders: ['content-type', 'idempotency-key'],
  // The replay marker, and when to retry a 409 or 503.
  exposedHeaders: ['idempotent-replayed', 'retry-after'],
  // One preflight per key would double a retry storm's requests; browsers cache the answer this long (s).
  maxAge: 600
} satisfies FastifyCorsOptions

export async function buildServer (): Promise<FastifyInstance> {
  const app = Fastify({ logger: true })
  // A real API scopes keys by the authenticated account (draft §5); the client address will do here.
  await app.register(idempotency, { scope: (request) => request.ip, required: true })
  await app.register(cors, corsOptions)
  let next = 1
  app.post('/payments', async (_request, reply) => {
    const id = `pay_${next++}`
    return reply.code(201).header('location', `/payments/${id}`).send({ id, status: 'succeeded' })
  })
  app.patch('/payments/:id', async (request) => ({ id: (request.params as { id: string }).id, updated: true }))
  return app
}

if (process.argv[1] !== undefined && import.meta.url === pathToFileURL(process.argv[1]).href) {
  const app = await buildServer()
  await app.listen({ host: '127.0.0.1', port: Number(process.env.PORT ?? 3000) })
}
