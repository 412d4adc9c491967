import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify'
import { answer, type HttpEngine } from './engine.js'
import { observedRequest } from './observed-request.js'
import type { GlobalSettings, StatusRouteSettings } from './options.js'
import type { StoredRecord } from '../core/store.js'
import { observe } from '../core/observe.js'
import { isReference, withoutMarker } from './reference.js'
import { scopeOf } from './scope.js'
import { bounded } from '../core/timeout.js'

/** What the status route answers (200, `application/json`) for a key the caller has a record of. */
export type IdempotencyKeyStatus =
  | { readonly state: 'in_progress' }
  | {
    readonly state: 'completed'
    readonly response: {
      /** The recorded HTTP status. */
      readonly status: number
      /** `includeBody` only: the recorded replayable headers. */
      readonly headers?: Readonly<Record<string, string | string[]>>
      /**
       * `includeBody` only: the recorded body, `null` when it exceeded `maxResponseBytes`, or when the
       * route records responses by reference (`rebuild`): a replay's body is rebuilt by that route from
       * the resource's current state, so only a retry of the request gets it. A JSON body
       * (`application/json`, `+json`) is embedded as it was sent; anything else is base64.
       */
      readonly body?: { readonly encoding: 'json', readonly value: unknown } | { readonly encoding: 'base64', readonly value: string } | null
    }
  }

const IN_PROGRESS = '{"state":"in_progress"}'
const JSON_MEDIA_TYPE = /^application\/(?:[a-z0-9!#$&^_.+-]*\+)?json[\t ]*(?:;|$)/i
const UTF8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true })

/**
 * `GET <url>`: the caller's own key, read with `store.get` (never a claim, so asking cannot start,
 * block or take over an operation). The key is looked up in the caller's scope only, so another
 * principal's key gets the very answer an unknown key gets (draft §5). Declared on the instance the
 * plugin is registered on (fastify-plugin), so it gets that instance's hooks, including those added
 * after the registration: Fastify binds a route's hooks when the instance becomes ready.
 */
export function registerStatusRoute (fastify: FastifyInstance, engine: HttpEngine, global: GlobalSettings, route: StatusRouteSettings): void {
  const settings = global.route
  async function keyStatus (request: FastifyRequest, reply: FastifyReply, key: string): Promise<FastifyReply> {
    const startedAt = performance.now()
    const invalid = invalidKey(key, settings.maxKeyLength)
    if (invalid !== null) return answer(engine, null, reply, { kind: 'key-invalid', detail: invalid })

    const scope = await scopeOf(settings.scope, request)
    let record: StoredRecord | null
    try {
      record = await bounded('get', settings.storeTimeout, () => engine.store.get({ scope, key }))
    } catch (err) {
      // Nothing runs on this route, so `onStoreError: 'bypass'` has nothing to bypass: always 503.
      observe(engine.metrics, observedRequest(request, key, scope, startedAt), 'store_error', 'error', 'idempotency: store failed on a key status lookup; answering 503', err)
      return answer(engine, null, reply, { kind: 'store-unavailable', retryAfter: settings.retryAfter })
    }
    if (record === null) return answer(engine, null, reply, { kind: 'key-unknown' })
    reply.header('content-type', 'application/json; charset=utf-8')
    // The state changes from one moment to the next and is one principal's business (RFC 9111 §5.2.2.5).
    reply.header('cache-control', 'no-store')
    return reply.send(statusBody(record, route.includeBody))
  }

  const { wildcardUrl, suffix } = splitAtKey(route.url)
  // The route reads: it must never be protected itself, whatever `methods` holds.
  const config = { idempotency: false }
  fastify.route({
    method: 'GET',
    url: route.url,
    config,
    handler: async function idempotencyKeyStatus (request, reply) {
      return await keyStatus(request, reply, (request.params as { key?: string }).key ?? '')
    }
  })
  // The router refuses a path parameter longer than its maxParamLength (100 by default) with its
  // own 414, although keys up to maxKeyLength (255) are accepted, and an over-long key is owed a
  // key-invalid problem. A wildcard has no such limit, and the router tries it only when the
  // parametric route did not match: longer keys, and a key holding an unencoded `/`.
  fastify.route({
    method: 'GET',
    url: wildcardUrl,
    config,
    handler: async function idempotencyKeyStatusLong (request, reply) {
      const rest = (request.params as { '*'?: string })['*'] ?? ''
      if (!rest.endsWith(suffix)) return reply.callNotFound()
      return await keyStatus(request, reply, rest.slice(0, rest.length - suffix.length))
    }
  })
}

/** `/a/:key/b` → `/a/*` and `/b`: the path after the key is static (options.ts checks it). */
function splitAtKey (url: string): { wildcardUrl: string, suffix: string } {
  const segments = url.split('/')
  const at = segments.indexOf(':key')
  const after = segments.slice(at + 1)
  return { wildcardUrl: [...segments.slice(0, at), '*'].join('/'), suffix: after.length === 0 ? '' : `/${after.join('/')}` }
}

/**
 * The path segment holds the key's value (what `request.idempotency.key` holds), percent-decoded
 * by the router. Every key a claim can accept is printable ASCII, of at most `maxKeyLength`.
 */
function invalidKey (key: string, maxLength: number): string | null {
  if (key.length === 0) return 'The Idempotency-Key must not be empty.'
  if (key.length > maxLength) return `The Idempotency-Key must be at most ${maxLength} characters long.`
  for (let i = 0; i < key.length; i++) {
    const c = key.charCodeAt(i)
    if (c < 0x20 || c > 0x7e) return 'The Idempotency-Key must be printable ASCII (percent-encode it in the path).'
  }
  return null
}

function statusBody (record: StoredRecord, includeBody: boolean): string {
  if (record.state === 'in_progress') return IN_PROGRESS
  const { statusCode, headers, body } = record.response
  if (!includeBody) return `{"state":"completed","response":{"status":${statusCode}}}`
  if (isReference(record.response)) {
    // A record by reference holds the route's internal reference and the marker field, which no
    // client was ever sent. The body a replay sends is the recording route's
    // rebuild(reference, request), serialized by that route: the status route knows neither (the
    // record does not name its route, and a rebuild may read the original request), so it answers
    // as for a body that was not retained.
    return `{"state":"completed","response":{"status":${statusCode},"headers":${JSON.stringify(withoutMarker(headers))},"body":null}}`
  }
  const contentType = headers['content-type']
  return `{"state":"completed","response":{"status":${statusCode},"headers":${JSON.stringify(headers)},` +
    `"body":${bodyMember(body, Array.isArray(contentType) ? contentType[0] : contentType)}}}`
}

/**
 * A JSON body is embedded verbatim, so the client reads the very bytes the original answer held
 * (numbers beyond double precision included); it must be UTF-8 (RFC 8259 §8.1) and one JSON value,
 * else (and for every other type) the bytes are sent as base64.
 */
function bodyMember (body: Buffer | null, contentType: string | undefined): string {
  if (body === null) return 'null'
  if (contentType !== undefined && JSON_MEDIA_TYPE.test(contentType)) {
    const text = jsonText(body)
    if (text !== null) return `{"encoding":"json","value":${text}}`
  }
  return `{"encoding":"base64","value":"${body.toString('base64')}"}`
}

function jsonText (body: Buffer): string | null {
  try {
    const text = UTF8.decode(body)
    JSON.parse(text)
    return text
  } catch {
    return null
  }
}
