import type { FastifySchema, RouteOptions } from 'fastify'
import type { HttpEngine } from './engine.js'
import type { GlobalSettings, RouteSettings } from './options.js'
import { PROBLEMS, type ProblemKind } from './problems.js'

/**
 * OpenAPI documentation of a protected route, written into `route.schema` when the route is added
 * (onRoute), so @fastify/swagger, or anything else that reads route schemas, shows the
 * Idempotency-Key contract: the request header, the plugin's error answers and the replay marker.
 *
 * Fastify compiles these same schema parts (`headers` into a validator, `response` into
 * serializers), so each addition is chosen to leave every request and response as it was:
 * - the header schema constrains nothing the plugin's onRequest hook has not already checked (it
 *   answers a missing or malformed key before validation runs), and is required only when every
 *   method of the route demands a key;
 * - a response code is added only where the route declares nothing that covers it (the code, its
 *   `4xx` range, `default`), because Fastify serializes a status with its most specific entry;
 * - the error answers are declared under their own media type (`application/problem+json`), which
 *   Fastify only serializes for an object sent with that type: the plugin sends ready-made strings,
 *   and a handler's own `application/json` 409 never meets this schema. A profile whose answers
 *   are `application/json` gets a schema without keywords, which serializes as JSON.stringify does;
 * - the success entry added to a route that declares none has no keywords either.
 * Schemas the app owns are copied, never mutated: one schema object may serve several routes.
 */
export function documentRoute (
  route: RouteOptions,
  engine: HttpEngine,
  global: GlobalSettings,
  settings: RouteSettings,
  methods: ReadonlySet<string> | null
): void {
  const schema: unknown = route.schema
  if (schema !== undefined && !isPlainObject(schema)) return
  const own: Schema = schema ?? {}
  // Zod, Valibot, Joi...: the route's compilers would be handed our JSON Schema and fail on it.
  if (usesAnotherSchemaLanguage(own)) return

  const documented: Schema = { ...own }
  let changed = false
  // A route with a `key` option does not read the header: documenting it would invite clients to send one.
  if (route.validatorCompiler === undefined && settings.key === null) {
    const headers = withKeyHeader(own.headers, keyParameter(settings, methods), settings.required && methods === null)
    if (headers !== undefined) {
      documented.headers = headers
      changed = true
    }
  }
  if (route.serializerCompiler === undefined) {
    documented.response = withResponses(own.response, engine, global, settings, methods)
    changed = true
  }
  if (changed) route.schema = documented as FastifySchema
}

type Schema = Record<string, unknown>

const KEY_HEADER = 'idempotency-key'
const REPLAYED_HEADER = 'idempotent-replayed'
const PROBLEM_JSON = 'application/problem+json'
const KEY_EXAMPLE = '"8e03978e-40d5-43e8-bc93-6894a57f9324"'
const DRAFT = 'draft-ietf-httpapi-idempotency-key-header'
const COMBINATORS = ['allOf', 'anyOf', 'oneOf', 'not', 'if'] as const
const VALIDATED_PARTS = ['body', 'querystring', 'query', 'params', 'headers'] as const

/** The plugin's answers on a protected route (the status route's `key-unknown` is not one). */
type RouteProblem = Extract<ProblemKind,
  'key-missing' | 'key-invalid' | 'key-reused' | 'request-in-progress' | 'response-not-retained' | 'store-unavailable' |
  'not-committed' | 'outcome-unknown' | 'transaction-ended' | 'body-too-deep' | 'body-too-large'>

const WHEN: Readonly<Record<RouteProblem, (settings: RouteSettings) => string>> = {
  // A route with a `key` option reads its key elsewhere (a webhook's event or delivery id), not from the header.
  'key-missing': (settings) => settings.key === null
    ? `The Idempotency-Key header is missing, and this operation requires one (${DRAFT} §2.7).`
    : 'The request carries no key where this operation looks for one (such as an event or delivery id), and this operation requires one.',
  'key-invalid': (settings) => settings.key === null
    ? 'The Idempotency-Key header is not a valid key: not a Structured Field String (RFC 9651 §3.3.3), ' +
      `empty, too long, or sent more than once (${DRAFT} §2.1).`
    : `The key this operation takes from the request is not valid: empty, longer than ${settings.maxKeyLength} characters, ` +
      'or holding control characters or unpaired surrogates.',
  'key-reused': () => 'The key was already used for a different request (method, target or body); the first request\'s ' +
    `outcome is kept, and is still replayed to that request (${DRAFT} §2.7).`,
  'request-in-progress': (settings) => 'A request with the same key is still being processed' +
    (settings.wait > 0 ? ` after waiting ${duration(settings.wait)} for it (less when the request asked for less with \`Prefer: wait=N\`, RFC 7240)` : '') +
    ` (${DRAFT} §2.6, §2.7). Send the same request again after \`Retry-After\` seconds.`,
  'response-not-retained': () => 'The operation for this key completed, but its response was too large to be recorded, ' +
    'so it cannot be replayed; it is not executed again (`originalStatus` is its status).',
  'store-unavailable': () => 'The key could not be checked, so the request was not processed. ' +
    'Send the same request again after `Retry-After` seconds.',
  'not-committed': () => 'The transaction holding the operation and its key could not be committed: nothing was recorded ' +
    'and its writes were rolled back. Send the same request again.',
  'outcome-unknown': () => 'The transaction holding the operation and its key was sent to be committed, but whether it ' +
    'committed could not be confirmed. Send the same request again after `Retry-After` seconds: it replays the recorded ' +
    'response if the operation committed, and runs it if it did not.',
  'transaction-ended': () => 'The operation ended its own transaction (COMMIT or ROLLBACK through the request\'s ' +
    'transaction handle) before its response was recorded: the key is held until the service reconciles it, and ' +
    'requests with it get 409 until then.',
  'body-too-deep': (settings) => `The parsed body nests arrays and objects more than ${settings.bodyLimits.maxDepth} levels deep, ` +
    'beyond what the request fingerprint accepts; nothing was processed or recorded.',
  'body-too-large': (settings) => `The parsed body holds more than ${settings.bodyLimits.maxNodes} values (strings, numbers, ` +
    'booleans, nulls, arrays and objects), beyond what the request fingerprint accepts; nothing was processed or recorded.'
}

function keyParameter (settings: RouteSettings, methods: ReadonlySet<string> | null): Schema {
  const lenient = settings.keyFormat === 'lenient'
    ? '; an unquoted key of visible ASCII without spaces, quotes or commas is also accepted'
    : ''
  let use: string
  if (methods !== null) {
    const only = [...methods].join(', ')
    use = ` Only ${only} requests to this path are protected; other methods ignore the header.` +
      (settings.required ? ` ${only} requests without it are refused (400).` : ` ${only} requests without it run unprotected.`)
  } else {
    use = settings.required ? '' : ' Optional: a request without it runs without this protection.'
  }
  return {
    type: 'string',
    description: 'Identifies one operation, so that a retry is never executed twice: send a new unique key (a UUID) ' +
      'for each operation, and the same key with the same request when retrying it. A retry of a completed operation ' +
      `gets its recorded response, with \`Idempotent-Replayed: true\` (${DRAFT}). ` +
      `A Structured Field String (RFC 9651 §3.3.3, draft §2.1): the key in double quotes, at most ${settings.maxKeyLength} ` +
      `characters between them${lenient}. Keys are kept ${duration(settings.ttl)} after their operation completed (draft §2.3).` +
      use,
    // Only annotations: the raw value's length also counts quotes, escapes and parameters, so a
    // maxLength here would refuse keys the parser accepts.
    examples: [KEY_EXAMPLE]
  }
}

/** The route's header schema with the key parameter, or undefined to leave it as it is. */
function withKeyHeader (existing: unknown, parameter: Schema, required: boolean): Schema | undefined {
  const ours: Schema = { type: 'object', properties: { [KEY_HEADER]: parameter } }
  if (required) ours.required = [KEY_HEADER]
  // `true` accepts any headers, and so does ours unless the key is required, which the plugin
  // enforces before validation anyway.
  if (existing === undefined || existing === true) return ours
  const theirs = isFluent(existing) ? (existing.valueOf() as unknown) : existing
  // `false` refuses every request: nothing to document.
  if (!isPlainObject(theirs)) return undefined
  if (declaresKey(theirs)) return undefined
  if (theirs.$ref === undefined && (theirs.properties !== undefined || !COMBINATORS.some((k) => theirs[k] !== undefined))) {
    const merged: Schema = { ...theirs, properties: { ...(theirs.properties as Schema | undefined), [KEY_HEADER]: parameter } }
    if (required) merged.required = [...(Array.isArray(theirs.required) ? theirs.required as unknown[] : []), KEY_HEADER]
    return merged
  }
  // A $ref or combinators: properties added beside them would hide theirs from swagger, which
  // reads either. Ours comes first: with Ajv's removeAdditional, a subschema of theirs with
  // `additionalProperties: false` strips the key, and a required check after it would then fail.
  return { allOf: [ours, theirs] }
}

function declaresKey (headers: Schema): boolean {
  return isPlainObject(headers.properties) && Object.keys(headers.properties).some((name) => name.toLowerCase() === KEY_HEADER)
}

function withResponses (
  existing: unknown,
  engine: HttpEngine,
  global: GlobalSettings,
  settings: RouteSettings,
  methods: ReadonlySet<string> | null
): Schema {
  const theirs: Schema = isPlainObject(existing) ? existing : {}
  const declared = new Set(Object.keys(theirs).map((code) => code.toLowerCase()))
  const covered = (status: number): boolean =>
    declared.has('default') || declared.has(String(status)) || declared.has(`${String(status).charAt(0)}xx`)
  const only = methods === null ? '' : ` (${[...methods].join(', ')} requests only.)`

  const response: Schema = {}
  for (const [code, entry] of Object.entries(theirs)) response[code] = withReplayHeader(code, entry, settings, only)
  if (![...declared].some((code) => code === 'default' || code.startsWith('2'))) {
    response['2xx'] = {
      // Read by swagger as the description; keyword-free for fast-json-stringify, which then
      // serializes exactly as JSON.stringify, Fastify's own fallback.
      'x-response-description': 'The operation\'s response. A retry of a completed operation gets the same response, ' +
        'replayed.',
      headers: { [REPLAYED_HEADER]: replayedHeader(only) }
    }
  }
  for (const [status, kinds] of problemsByStatus(engine, settings)) {
    if (!covered(status)) response[String(status)] = problemResponse(kinds, engine, global, settings, only)
  }
  return response
}

/** A declared response the plugin may replay gets the replay marker; everything else is kept as it is. */
function withReplayHeader (code: string, entry: unknown, settings: RouteSettings, only: string): unknown {
  const status = /^[1-5]xx$/i.test(code) ? Number(code.charAt(0)) * 100 : Number(code)
  if (!Number.isInteger(status) || !settings.record(status)) return entry
  if (!isPlainObject(entry) || entry.$ref !== undefined) return entry
  if (entry.headers !== undefined && !isPlainObject(entry.headers)) return entry
  return { ...entry, headers: { [REPLAYED_HEADER]: replayedHeader(only), ...entry.headers } }
}

function replayedHeader (only: string): Schema {
  return {
    type: 'string',
    enum: ['true'],
    description: '`true` when this is the recorded response of an earlier request with the same Idempotency-Key, ' +
      'replayed without executing the operation again; absent on the original response. A convention (Stripe and ' +
      `others) rather than part of the draft.${only}`
  }
}

function problemsByStatus (engine: HttpEngine, settings: RouteSettings): Map<number, RouteProblem[]> {
  const kinds: RouteProblem[] = []
  if (settings.required) kinds.push('key-missing')
  kinds.push('key-invalid', 'key-reused', 'request-in-progress', 'response-not-retained')
  // Only the canonical fingerprint walks the body (raw hashes bytes, custom is the app's).
  if (settings.fingerprint.mode === 'canonical') kinds.push('body-too-deep', 'body-too-large')
  // With 'bypass', a store failure runs the handler unprotected instead.
  if (settings.onStoreError === 'fail') kinds.push('store-unavailable')
  if (settings.transaction) kinds.push('not-committed', 'outcome-unknown', 'transaction-ended')
  const byStatus = new Map<number, RouteProblem[]>()
  for (const kind of kinds) {
    const status = engine.problems[kind].status
    const list = byStatus.get(status)
    if (list === undefined) byStatus.set(status, [kind])
    else list.push(kind)
  }
  return byStatus
}

/** One status's answers, each as the plugin sends it (the rendered body is the example). */
function problemResponse (
  kinds: readonly RouteProblem[],
  engine: HttpEngine,
  global: GlobalSettings,
  settings: RouteSettings,
  only: string
): Schema {
  const headers: Schema = {}
  const content: Record<string, { schema: Schema, examples: Schema }> = {}
  for (const kind of kinds) {
    const problem = engine.problems[kind]
    if (kind === 'request-in-progress' || kind === 'store-unavailable') {
      headers['retry-after'] = {
        type: 'integer',
        minimum: 0,
        description: `Seconds to wait before sending the same request again (RFC 9110 §10.2.3); ${settings.retryAfter} on this route.`
      }
    }
    for (const [name, value] of problem.headers) {
      const known = headers[name] as { enum: string[] } | undefined
      if (known === undefined) headers[name] = { type: 'string', enum: [value] }
      else if (!known.enum.includes(value)) known.enum.push(value)
    }
    const media = content[problem.contentType] ??= {
      schema: problem.contentType === PROBLEM_JSON ? problemDetailsSchema() : opaqueErrorSchema(),
      examples: {}
    }
    if (kind === 'response-not-retained' && problem.contentType === PROBLEM_JSON) {
      (media.schema.properties as Schema).originalStatus = { type: 'integer', description: 'The status of the response that was not recorded.' }
    }
    media.examples[kind] = { summary: PROBLEMS[kind].title, value: JSON.parse(problem.body) as unknown }
  }
  if (global.docsUrl !== null) {
    headers.link = { type: 'string', description: `\`<${global.docsUrl}>; rel="describedby"\`: documentation of these errors (${DRAFT} §2.7).` }
  }
  const answer: Schema = { description: kinds.map((kind) => WHEN[kind](settings)).join(' ') + only, content }
  if (Object.keys(headers).length > 0) answer.headers = headers
  return answer
}

/**
 * RFC 9457 §3.1. Permissive: an app's own `application/problem+json` object with this status is
 * serialized by it, so its extension members must pass through (and no member is `required`,
 * which would make fast-json-stringify throw on one that lacks it).
 */
function problemDetailsSchema (): Schema {
  return {
    type: 'object',
    properties: {
      type: { type: 'string', format: 'uri', description: 'Identifies the problem type (RFC 9457 §3.1.1).' },
      title: { type: 'string', description: 'A short summary of the problem type (RFC 9457 §3.1.3).' },
      status: { type: 'integer', description: 'The HTTP status code (RFC 9457 §3.1.2).' },
      detail: { type: 'string', description: 'An explanation of this occurrence (RFC 9457 §3.1.4).' }
    },
    additionalProperties: true
  }
}

/** Without keywords, so an app's own JSON answer with this status is serialized exactly as before. */
function opaqueErrorSchema (): Schema {
  return { description: 'An error object, as in the examples.' }
}

/** Any part written for another compiler than Fastify's JSON Schema ones (Ajv, fast-json-stringify). */
function usesAnotherSchemaLanguage (schema: Schema): boolean {
  for (const part of VALIDATED_PARTS) {
    if (isForeign(schema[part])) return true
  }
  if (isPlainObject(schema.body) && hasForeignContent(schema.body.content)) return true
  const response = schema.response
  if (response === undefined) return false
  if (!isPlainObject(response)) return true
  for (const entry of Object.values(response)) {
    if (isForeign(entry)) return true
    if (isPlainObject(entry) && hasForeignContent(entry.content)) return true
  }
  return false
}

function hasForeignContent (content: unknown): boolean {
  if (!isPlainObject(content)) return false
  return Object.values(content).some((media) => isPlainObject(media) && isForeign(media.schema))
}

function isForeign (value: unknown): boolean {
  if (value === undefined || typeof value === 'boolean' || isFluent(value)) return false
  // Zod, Joi, Yup... are class instances; Valibot and others expose the Standard Schema `~standard`.
  return !isPlainObject(value) || '~standard' in value
}

/** fluent-json-schema objects, which Fastify itself turns into JSON Schema with valueOf(). */
function isFluent (value: unknown): value is { valueOf: () => unknown } {
  if (typeof value !== 'object' || value === null) return false
  const fluent = value as Record<string | symbol, unknown>
  return Boolean(fluent.isFluentSchema || fluent.isFluentJSONSchema || fluent[Symbol.for('fluent-schema-object')])
}

function isPlainObject (value: unknown): value is Schema {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) return false
  const prototype: unknown = Object.getPrototypeOf(value)
  return prototype === Object.prototype || prototype === null
}

function duration (ms: number): string {
  for (const [unit, size] of [['day', 86_400_000], ['hour', 3_600_000], ['minute', 60_000], ['second', 1_000]] as const) {
    if (ms % size === 0) return `${ms / size} ${unit}${ms === size ? '' : 's'}`
  }
  return `${ms} ms`
}
