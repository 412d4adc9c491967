import { createServer, type IncomingMessage, type Server } from 'node:http'
import type { AddressInfo } from 'node:net'

/**
 * A downstream provider (a card network, an email service) that honours its own Idempotency-Key
 * the way Stripe does: the first call with a key takes effect, a repeat gets the first answer and
 * no new effect. It logs every call, repeats included, so a test can count both calls and effects.
 *
 *   POST /<resource>          with Idempotency-Key: creates { id, resource, key, body }
 *   GET  /<resource>/<key>    the effect recorded for that key, or 404 (what a reconciler asks)
 */
export interface ProviderCall { readonly method: string, readonly resource: string, readonly key: string }

export interface FakeProvider {
  readonly url: string
  readonly calls: ProviderCall[]
  /** Effects by resource, then by idempotency key. */
  readonly effects: Map<string, Map<string, unknown>>
  effectsOf (resource: string): number
  close (): Promise<void>
}

export async function startFakeProvider (): Promise<FakeProvider> {
  const calls: ProviderCall[] = []
  const effects = new Map<string, Map<string, unknown>>()
  let next = 0
  const server: Server = createServer((request, response) => {
    readBody(request).then((text) => {
      const [, resource = '', lookup] = (request.url ?? '').split('/')
      const key = request.method === 'GET' ? decodeURIComponent(lookup ?? '') : String(request.headers['idempotency-key'] ?? '')
      calls.push({ method: request.method ?? '', resource, key })
      const byKey = effects.get(resource) ?? new Map<string, unknown>()
      effects.set(resource, byKey)
      response.setHeader('content-type', 'application/json')
      if (request.method === 'GET') {
        const found = byKey.get(key)
        response.statusCode = found === undefined ? 404 : 200
        response.end(JSON.stringify(found ?? { error: 'not found' }))
        return
      }
      if (key === '') {
        response.statusCode = 400
        response.end(JSON.stringify({ error: 'Idempotency-Key required' }))
        return
      }
      if (!byKey.has(key)) byKey.set(key, { id: `${resource}_${++next}`, resource, key, body: text === '' ? null : JSON.parse(text) })
      response.end(JSON.stringify(byKey.get(key)))
    }, () => { response.statusCode = 400; response.end() })
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as AddressInfo
  return {
    url: `http://127.0.0.1:${port}`,
    calls,
    effects,
    effectsOf: (resource) => effects.get(resource)?.size ?? 0,
    close: () => new Promise<void>((resolve) => { server.closeAllConnections(); server.close(() => resolve()) })
  }
}

async function readBody (request: IncomingMessage): Promise<string> {
  const chunks: Buffer[] = []
  for await (const chunk of request) chunks.push(chunk as Buffer)
  return Buffer.concat(chunks).toString('utf8')
}
