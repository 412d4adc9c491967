import type { FastifyRequest } from 'fastify'
import { InvalidOptionError } from '../core/errors.js'
import type { CanonicalLimits } from '../core/fingerprint-canonical.js'
import { DEFAULT_REPLAY_HEADERS, isSensitiveHeader, NEVER_REPLAYED } from './headers.js'
import type { KeyFormat, KeyFunction } from './key.js'
import { resolveKeyring, type EncryptionOptions, type Keyring } from '../core/keyring.js'
import type { RebuildFunction } from './reference.js'
import { createMetrics, type MeterLike, type Metrics } from '../core/observe.js'
import { PROFILE_NAMES, type ProfileName } from './profiles.js'
import { booleanOption, integerOption, MAX_TIMER_MS } from '../core/validate.js'
import { refuseEmptyScope, type ScopeFunction } from './scope.js'
import type { IdempotencyPrefilter } from '../core/prefilter.js'
import type { IdempotencyStore } from '../core/store.js'

/**
 * A user-supplied fingerprint: whatever it returns is hashed (SHA-256) and stored with algorithm
 * `custom-v1`. It decides alone what makes two requests "the same" (draft §2.4 lists checksums of
 * selected elements among the options), so it usually covers the method and target too.
 */
export type FingerprintFunction = (request: FastifyRequest) => string | Buffer | Promise<string | Buffer>

export type FingerprintOption = 'canonical' | 'raw' | FingerprintFunction

/** What a route for a protected method declared before the plugin loaded does to the boot (lib/fastify/earlier-routes.ts). */
export type EarlierRoutesPolicy = 'fail' | 'warn'

export type { ScopeFunction }
export type RecordRule = (statusCode: number) => boolean

/** Options that make sense per route, in `config: { idempotency: { ... } }` as well as at registration. */
export interface RouteIdempotencyOptions {
  /**
   * The principal that owns keys (tenant, account): the same key from two scopes is two operations.
   * An empty string is refused (500) unless `allowEmptyScope` is set.
   * @defaultValue one global scope (with a startup warning, FST_IDEMPOTENCY_UNSCOPED)
   */
  scope?: ScopeFunction
  /** Answer 400 to a protected request without the header, instead of running it unprotected. @defaultValue false */
  required?: boolean
  /** How long a record is kept after it was completed, in ms (the published expiry policy, draft §2.3). @defaultValue 86_400_000 (24 h) */
  ttl?: number
  /**
   * How long an in-progress key stays with its owner without a renewal, in ms: a crashed owner's key
   * can be taken over by a retry this long after its last renewal. A live owner renews it (every
   * lease / 3) until its outcome is recorded, whatever its client does. @defaultValue 30_000
   */
  lease?: number
  /**
   * The longest a live owner keeps renewing its lease, in ms, from its claim; 0 for as long as it
   * runs. A bound for handlers that can hang: once it elapsed, the lease lapses and a retry may take
   * the key over and run the operation beside the stuck handler (steps already recorded are not
   * repeated). Lease mode only. @defaultValue 0 (no bound)
   */
  maxOwnership?: number
  /** How long a duplicate waits for an in-flight original before it gets 409, in ms. @defaultValue 0 */
  wait?: number
  /**
   * Where the key comes from when it is not the `Idempotency-Key` header: a webhook's event id in
   * another header (`(request) => request.headers['webhook-id']`) or in the parsed body
   * (`(request) => request.body.id`). Called in the claim, the route's last preHandler: after every
   * onRequest, preParsing, preValidation and preHandler hook before it, so a request that fails
   * its verification (a bad signature) never reaches the store. The key is taken verbatim (no
   * Structured Field parsing) and checked against `maxKeyLength`; `undefined` means no key (400
   * when `required`, else the request runs unprotected). The header is not read on such a route.
   * @defaultValue the `Idempotency-Key` header
   */
  key?: KeyFunction
  /** @defaultValue 255 */
  maxKeyLength?: number
  /** `'lenient'` also accepts a bare (unquoted) key; `'strict'` only the draft's sf-string. @defaultValue 'lenient' */
  keyFormat?: KeyFormat
  /** @defaultValue 'canonical' */
  fingerprint?: FingerprintOption
  /**
   * Canonical fingerprints only: a parsed body whose arrays and objects are nested deeper than
   * this is refused with a 400 problem (`body-too-deep`) before the handler runs. @defaultValue 128
   */
  maxBodyDepth?: number
  /**
   * Canonical fingerprints only: a parsed body holding more values than this (every string,
   * number, boolean, null, array and object counts one) is refused with a 413 problem
   * (`body-too-large`) before the handler runs. The default is twice what a 1 MiB JSON text can
   * hold, so only a parsed form larger than its text (a parser that shares one object between
   * places, as YAML aliases do) or a `bodyLimit` above 2 MiB reaches it. @defaultValue 1_048_576
   */
  maxBodyNodes?: number
  /** Which handler responses are recorded; the others release the key. @defaultValue every status below 500 except 429 */
  record?: RecordRule
  /** Bodies larger than this are not retained; a retry then gets a 410 problem, never a re-execution. @defaultValue 1_048_576 */
  maxResponseBytes?: number
  /**
   * Response headers recorded and replayed (case-insensitive). Credential, cookie and security-policy
   * headers (SENSITIVE_HEADERS, every `access-control-*`) are refused: see `unsafeReplayHeaders`.
   * @defaultValue see DEFAULT_REPLAY_HEADERS
   */
  replayHeaders?: readonly string[]
  /**
   * DANGEROUS. Credential, cookie or security-policy headers recorded and replayed in addition to
   * `replayHeaders`: every retry of the key, by whichever client sends it within its scope, gets
   * the value the original answer carried (a challenge, a session, a policy computed for another
   * origin or moment). Only for a value that is the same for every caller of the key. Set-Cookie,
   * hop-by-hop and per-message headers stay refused. @defaultValue none
   */
  unsafeReplayHeaders?: readonly string[]
  /** What a store failure does: `'fail'` answers 503; `'bypass'` runs the handler unprotected and logs it. @defaultValue 'fail' */
  onStoreError?: 'fail' | 'bypass'
  /** A store call slower than this counts as a store failure, in ms. @defaultValue 5_000 */
  storeTimeout?: number
  /** Seconds in the `Retry-After` of 409 and 503 answers. @defaultValue 1 */
  retryAfter?: number
  /**
   * Atomic mode: claim the key inside a transaction the handler writes through
   * (`request.idempotency.sql`), committed together with the recorded response. Needs a store with
   * `claimInTransaction` (the Postgres driver). @defaultValue false
   */
  transaction?: boolean
  /**
   * Responses by reference: when the handler sets `request.idempotency.reference`, that (JSON) value
   * is recorded instead of the response body, and a replay calls `rebuild(reference, request)` to
   * answer from the resource's current state. @defaultValue none (bodies are recorded)
   */
  rebuild?: RebuildFunction
}

export interface IdempotencyOptions extends RouteIdempotencyOptions {
  /** @defaultValue memoryStore() */
  store?: IdempotencyStore
  /** Answers duplicates before the store during retry storms (never decides who executes). @defaultValue none */
  prefilter?: IdempotencyPrefilter
  /** Methods protected without a route opting in. @defaultValue ['POST', 'PATCH'] */
  methods?: readonly string[]
  /**
   * Adds `GET <url>`, where a caller asks about its own key: in progress, completed (with the
   * recorded status), or unknown (404). Scoped by `scope`, like claims; it never claims.
   * @defaultValue none (no route)
   */
  statusRoute?: string | StatusRouteOptions
  /** The shape of the plugin's error answers: RFC 9457 problems, or Stripe's error object. @defaultValue 'ietf' */
  profile?: ProfileName
  /** Prefix of the problem `type` URIs. @defaultValue 'tag:fastify-idempotency,2026:' */
  problemTypeBase?: string
  /** Documentation linked from every problem with `Link: rel="describedby"`. @defaultValue none */
  docsUrl?: string
  /**
   * Documents each protected route in its schema (the Idempotency-Key header, the plugin's error
   * answers, the replay marker) for @fastify/swagger (lib/http/openapi.ts). `'auto'`: only when
   * @fastify/swagger is registered (the instance has its `swagger` decorator when the route is
   * added), since Fastify also compiles what is documented (a header validator, serializers) and
   * an app without a spec should not pay for one. Set `false` when the app replaces Fastify's JSON
   * Schema compilers for all routes (`setValidatorCompiler`, e.g. Zod).
   * @defaultValue 'auto'
   */
  openapi?: boolean | 'auto'
  /**
   * Encrypts recorded response headers and bodies at rest (AES-256-GCM); the first key seals, every
   * key opens. Registration only. @defaultValue none (responses are stored in clear)
   */
  encryption?: EncryptionOptions
  /**
   * An OpenTelemetry-compatible Meter (`metrics.getMeter('fastify-idempotency')`, or anything with
   * createCounter / createHistogram): every decision adds to the counter `idempotency.decisions` and
   * the histogram `idempotency.decision.duration` (ms), with attributes outcome, method and route.
   * @defaultValue none
   */
  metrics?: MeterLike
  /**
   * What a route for a protected method declared before the plugin loaded does to the boot: Fastify
   * never showed it to the plugin, so it runs unprotected. `'fail'`: `ready()` rejects with
   * `UnprotectedRoutesError`, naming the routes; `'warn'`: a logged process warning
   * (`FST_IDEMPOTENCY_UNPROTECTED_ROUTES`), for routes meant to run unprotected. @defaultValue 'fail'
   */
  onEarlierRoutes?: EarlierRoutesPolicy
  /**
   * Lets the scope function return `''`, one scope shared by every caller it returns it for
   * (anonymous callers, say). Without it such a request is refused with a 500 and a logged reason.
   * @defaultValue false
   */
  allowEmptyScope?: boolean
}

export interface StatusRouteOptions {
  /** The route's path, with a `:key` path segment, e.g. `'/idempotency-keys/:key'`. */
  url: string
  /** Also answer a completed key's recorded headers and body. @defaultValue false */
  includeBody?: boolean
}

export interface StatusRouteSettings {
  readonly url: string
  readonly includeBody: boolean
}

export type ResolvedFingerprint =
  | { readonly mode: 'canonical' }
  | { readonly mode: 'raw' }
  | { readonly mode: 'custom', readonly fn: FingerprintFunction }

/** Everything a protected route needs per request, decided once. */
export interface RouteSettings {
  readonly scope: ScopeFunction | null
  readonly required: boolean
  readonly ttl: number
  readonly lease: number
  readonly maxOwnership: number
  readonly wait: number
  /** The `key` option, or null to read the `Idempotency-Key` header. */
  readonly key: KeyFunction | null
  readonly maxKeyLength: number
  readonly keyFormat: KeyFormat
  readonly fingerprint: ResolvedFingerprint
  /** maxBodyDepth and maxBodyNodes, as the canonical walk takes them. */
  readonly bodyLimits: CanonicalLimits
  readonly record: RecordRule
  readonly maxResponseBytes: number
  /** What is recorded and replayed: `listedReplayHeaders` and `unsafeReplayHeaders` together. */
  readonly replayHeaders: ReadonlySet<string>
  /** The `replayHeaders` option as resolved (inherited separately from the forced ones). */
  readonly listedReplayHeaders: ReadonlySet<string>
  readonly unsafeReplayHeaders: ReadonlySet<string>
  readonly onStoreError: 'fail' | 'bypass'
  readonly storeTimeout: number
  readonly retryAfter: number
  readonly transaction: boolean
  readonly rebuild: RebuildFunction | null
}

export interface GlobalSettings {
  readonly methods: ReadonlySet<string>
  readonly statusRoute: StatusRouteSettings | null
  readonly profile: ProfileName
  readonly problemTypeBase: string
  readonly docsUrl: string | null
  readonly openapi: boolean | 'auto'
  /** Keys sealing recorded responses, or null. */
  readonly encryption: Keyring | null
  readonly metrics: Metrics | null
  readonly onEarlierRoutes: EarlierRoutesPolicy
  readonly allowEmptyScope: boolean
  readonly route: RouteSettings
}

const ROUTE_OPTION_NAMES = [
  'scope', 'required', 'ttl', 'lease', 'maxOwnership', 'wait', 'key', 'maxKeyLength', 'keyFormat', 'fingerprint', 'maxBodyDepth', 'maxBodyNodes', 'record',
  'maxResponseBytes', 'replayHeaders', 'unsafeReplayHeaders', 'onStoreError', 'storeTimeout', 'retryAfter', 'transaction', 'rebuild'
] as const
const GLOBAL_OPTION_NAMES = new Set<string>([...ROUTE_OPTION_NAMES, 'store', 'prefilter', 'methods', 'problemTypeBase', 'docsUrl', 'encryption', 'statusRoute', 'profile', 'openapi', 'metrics', 'onEarlierRoutes', 'allowEmptyScope'])
const ROUTE_ONLY = new Set<string>(ROUTE_OPTION_NAMES)

const HTTP_METHODS = new Set(['DELETE', 'GET', 'HEAD', 'PATCH', 'POST', 'PUT', 'OPTIONS', 'PROPFIND', 'PROPPATCH',
  'MKCOL', 'COPY', 'MOVE', 'LOCK', 'UNLOCK', 'TRACE', 'SEARCH', 'REPORT', 'MKCALENDAR', 'QUERY'])
const HEADER_NAME = /^[!#$%&'*+.^_`|~0-9a-zA-Z-]+$/
const ABSOLUTE_URI = /^[a-zA-Z][a-zA-Z0-9+.-]*:\S+$/

/*
 * The canonical walk's bounds (lib/core/fingerprint-canonical.ts). 128 levels: twice .NET's
 * System.Text.Json default (64) and serde_json's recursion limit; request bodies of real APIs
 * nest a handful of levels, and thousands of levels are only ever an attack (or a bug). 2^20
 * values: a JSON text of n bytes holds at most n / 2 + 1 values ("[0,0,...]"), so Fastify's
 * default bodyLimit (1 MiB) never reaches it.
 */
const DEFAULT_MAX_BODY_DEPTH = 128
const DEFAULT_MAX_BODY_NODES = 1_048_576

const DEFAULT_ROUTE: RouteSettings = Object.freeze({
  scope: null,
  required: false,
  ttl: 24 * 60 * 60 * 1000,
  lease: 30_000,
  maxOwnership: 0,
  wait: 0,
  key: null,
  maxKeyLength: 255,
  keyFormat: 'lenient',
  fingerprint: Object.freeze({ mode: 'canonical' }),
  bodyLimits: Object.freeze({ maxDepth: DEFAULT_MAX_BODY_DEPTH, maxNodes: DEFAULT_MAX_BODY_NODES }),
  record: (statusCode: number) => statusCode < 500 && statusCode !== 429,
  maxResponseBytes: 1024 * 1024,
  replayHeaders: new Set(DEFAULT_REPLAY_HEADERS),
  listedReplayHeaders: new Set(DEFAULT_REPLAY_HEADERS),
  unsafeReplayHeaders: new Set<string>(),
  onStoreError: 'fail',
  storeTimeout: 5_000,
  retryAfter: 1,
  transaction: false,
  rebuild: null
})

export function resolveGlobalOptions (options: IdempotencyOptions): GlobalSettings {
  checkObject('options', options)
  for (const name of Object.keys(options)) {
    if (!GLOBAL_OPTION_NAMES.has(name)) throw new InvalidOptionError(`option "${name}"`, `one of ${[...GLOBAL_OPTION_NAMES].join(', ')}`, (options as Record<string, unknown>)[name])
  }
  const methods = options.methods === undefined
    ? new Set(['POST', 'PATCH'])
    : resolveMethods(options.methods)
  const problemTypeBase = options.problemTypeBase ?? 'tag:fastify-idempotency,2026:'
  if (typeof problemTypeBase !== 'string' || !ABSOLUTE_URI.test(problemTypeBase)) {
    throw new InvalidOptionError('option "problemTypeBase"', 'an absolute URI (RFC 9457 §3.1.1)', problemTypeBase)
  }
  const allowEmptyScope = booleanOption('option "allowEmptyScope"', options.allowEmptyScope, false)
  let docsUrl: string | null = null
  if (options.docsUrl !== undefined) {
    if (typeof options.docsUrl !== 'string' || !/^https?:\/\/\S+$/.test(options.docsUrl) || options.docsUrl.includes('>')) {
      throw new InvalidOptionError('option "docsUrl"', 'an http(s) URL', options.docsUrl)
    }
    docsUrl = options.docsUrl
  }
  return Object.freeze({
    methods,
    statusRoute: resolveStatusRoute(options.statusRoute),
    profile: options.profile === undefined ? 'ietf' : oneOf('option "profile"', options.profile, PROFILE_NAMES),
    problemTypeBase,
    docsUrl,
    openapi: options.openapi === undefined ? 'auto' : oneOfValues('option "openapi"', options.openapi, [true, false, 'auto'] as const),
    encryption: options.encryption === undefined ? null : resolveKeyring(options.encryption),
    metrics: createMetrics(options.metrics),
    onEarlierRoutes: options.onEarlierRoutes === undefined ? 'fail' : oneOf('option "onEarlierRoutes"', options.onEarlierRoutes, ['fail', 'warn']),
    allowEmptyScope,
    route: mergeRouteOptions(DEFAULT_ROUTE, options, 'option', allowEmptyScope)
  })
}

/** An explicit route config: `false` means unprotected (null); `true` or an object protect every method of the route. */
export function resolveRouteConfig (global: GlobalSettings, config: unknown, where: string): RouteSettings | null {
  if (config === false) return null
  if (config === true) return global.route
  checkObject(`${where} config.idempotency`, config)
  for (const name of Object.keys(config)) {
    if (!ROUTE_ONLY.has(name)) {
      throw new InvalidOptionError(`${where} config.idempotency.${name}`, `one of ${ROUTE_OPTION_NAMES.join(', ')} (or true / false)`, (config as Record<string, unknown>)[name])
    }
  }
  return mergeRouteOptions(global.route, config as RouteIdempotencyOptions, `${where} config.idempotency`, global.allowEmptyScope)
}

function mergeRouteOptions (base: RouteSettings, options: RouteIdempotencyOptions, prefix: string, allowEmptyScope: boolean): RouteSettings {
  const name = (option: string): string => prefix === 'option' ? `option "${option}"` : `${prefix}.${option}`
  const settings: RouteSettings = {
    scope: options.scope === undefined ? base.scope : refuseEmptyScope(fn(name('scope'), options.scope), allowEmptyScope),
    required: booleanOption(name('required'), options.required, base.required),
    ttl: integerOption(name('ttl'), options.ttl, base.ttl, 1, MAX_TIMER_MS, 'milliseconds'),
    // A ttl shorter than the inherited lease shortens the lease with it; an explicit lease longer
    // than the ttl is refused below.
    lease: options.lease === undefined
      ? (options.ttl === undefined ? base.lease : Math.min(base.lease, integerOption(name('ttl'), options.ttl, base.ttl, 1, MAX_TIMER_MS, 'milliseconds')))
      : integerOption(name('lease'), options.lease, base.lease, 1, MAX_TIMER_MS, 'milliseconds'),
    maxOwnership: integerOption(name('maxOwnership'), options.maxOwnership, base.maxOwnership, 0, MAX_TIMER_MS, 'milliseconds'),
    wait: integerOption(name('wait'), options.wait, base.wait, 0, MAX_TIMER_MS, 'milliseconds'),
    key: options.key === undefined ? base.key : fn(name('key'), options.key),
    maxKeyLength: integerOption(name('maxKeyLength'), options.maxKeyLength, base.maxKeyLength, 1, 8192, 'characters'),
    keyFormat: options.keyFormat === undefined ? base.keyFormat : oneOf(name('keyFormat'), options.keyFormat, ['lenient', 'strict']),
    fingerprint: options.fingerprint === undefined ? base.fingerprint : resolveFingerprint(name('fingerprint'), options.fingerprint),
    bodyLimits: resolveBodyLimits(base.bodyLimits, options, name),
    record: options.record === undefined ? base.record : fn(name('record'), options.record),
    maxResponseBytes: integerOption(name('maxResponseBytes'), options.maxResponseBytes, base.maxResponseBytes, 0, Number.MAX_SAFE_INTEGER, 'bytes'),
    ...replayHeaderSettings(base, options, name),
    onStoreError: options.onStoreError === undefined ? base.onStoreError : oneOf(name('onStoreError'), options.onStoreError, ['fail', 'bypass']),
    storeTimeout: integerOption(name('storeTimeout'), options.storeTimeout, base.storeTimeout, 1, MAX_TIMER_MS, 'milliseconds'),
    retryAfter: integerOption(name('retryAfter'), options.retryAfter, base.retryAfter, 0, 86_400, 'seconds'),
    transaction: booleanOption(name('transaction'), options.transaction, base.transaction),
    rebuild: options.rebuild === undefined ? base.rebuild : fn(name('rebuild'), options.rebuild)
  }
  if (settings.lease > settings.ttl) {
    throw new InvalidOptionError(name('lease'), `at most the ttl (${settings.ttl} ms): a record must outlive its owner's lease`, settings.lease)
  }
  return Object.freeze(settings)
}

function checkObject (name: string, value: unknown): asserts value is object {
  if (value === null || typeof value !== 'object' || Array.isArray(value)) throw new InvalidOptionError(name, 'an object', value)
}

function fn<T> (name: string, value: T): T {
  if (typeof value !== 'function') throw new InvalidOptionError(name, 'a function', value)
  return value
}

function oneOfValues<T extends boolean | string> (name: string, value: unknown, allowed: readonly T[]): T {
  if (!allowed.includes(value as T)) throw new InvalidOptionError(name, allowed.map((a) => typeof a === 'string' ? `'${a}'` : String(a)).join(', '), value)
  return value as T
}

function oneOf<T extends string> (name: string, value: unknown, allowed: readonly T[]): T {
  if (!allowed.includes(value as T)) throw new InvalidOptionError(name, `one of ${allowed.map((a) => `'${a}'`).join(', ')}`, value)
  return value as T
}

function resolveBodyLimits (base: CanonicalLimits, options: RouteIdempotencyOptions, name: (option: string) => string): CanonicalLimits {
  if (options.maxBodyDepth === undefined && options.maxBodyNodes === undefined) return base
  return Object.freeze({
    maxDepth: integerOption(name('maxBodyDepth'), options.maxBodyDepth, base.maxDepth, 1, Number.MAX_SAFE_INTEGER, 'levels'),
    maxNodes: integerOption(name('maxBodyNodes'), options.maxBodyNodes, base.maxNodes, 1, Number.MAX_SAFE_INTEGER, 'values')
  })
}

function resolveFingerprint (name: string, value: unknown): ResolvedFingerprint {
  if (value === 'canonical') return Object.freeze({ mode: 'canonical' })
  if (value === 'raw') return Object.freeze({ mode: 'raw' })
  if (typeof value === 'function') return Object.freeze({ mode: 'custom', fn: value as FingerprintFunction })
  throw new InvalidOptionError(name, "'canonical', 'raw' or a function", value)
}

function resolveMethods (value: unknown): ReadonlySet<string> {
  if (!Array.isArray(value) || value.length === 0) throw new InvalidOptionError('option "methods"', 'a non-empty array of HTTP methods', value)
  const methods = new Set<string>()
  for (const method of value) {
    if (typeof method !== 'string' || !HTTP_METHODS.has(method.toUpperCase())) {
      throw new InvalidOptionError('option "methods"', `an array of HTTP methods (${[...HTTP_METHODS].join(', ')})`, method)
    }
    methods.add(method.toUpperCase())
  }
  return methods
}

/**
 * `replayHeaders` and `unsafeReplayHeaders`, each inherited on its own (a route that sets one keeps
 * the other from the registration), and the set that is recorded: both together.
 */
function replayHeaderSettings (base: RouteSettings, options: RouteIdempotencyOptions, name: (option: string) => string): Pick<RouteSettings, 'replayHeaders' | 'listedReplayHeaders' | 'unsafeReplayHeaders'> {
  if (options.replayHeaders === undefined && options.unsafeReplayHeaders === undefined) {
    return { replayHeaders: base.replayHeaders, listedReplayHeaders: base.listedReplayHeaders, unsafeReplayHeaders: base.unsafeReplayHeaders }
  }
  const listed = options.replayHeaders === undefined ? base.listedReplayHeaders : resolveReplayHeaders(name('replayHeaders'), options.replayHeaders, false)
  const unsafe = options.unsafeReplayHeaders === undefined ? base.unsafeReplayHeaders : resolveReplayHeaders(name('unsafeReplayHeaders'), options.unsafeReplayHeaders, true)
  return { replayHeaders: new Set([...listed, ...unsafe]), listedReplayHeaders: listed, unsafeReplayHeaders: unsafe }
}

/**
 * Header names, lower-cased. Never the NEVER_REPLAYED set. `replayHeaders` (unsafe false) refuses
 * credential, cookie and security-policy headers; `unsafeReplayHeaders` (unsafe true) takes only
 * those, so the list of forced headers is exactly the list of risks taken.
 */
function resolveReplayHeaders (name: string, value: unknown, unsafe: boolean): ReadonlySet<string> {
  if (!Array.isArray(value)) throw new InvalidOptionError(name, 'an array of header names', value)
  const headers = new Set<string>()
  for (const header of value) {
    if (typeof header !== 'string' || !HEADER_NAME.test(header)) throw new InvalidOptionError(name, 'an array of header names', header)
    const lower = header.toLowerCase()
    // A name on the plugin's own lists is shown as written: it is one of the plugin's names, not data.
    const listed = `'${header}'`
    if (NEVER_REPLAYED.has(lower)) {
      throw new InvalidOptionError(name, `free of headers that are never replayed (${[...NEVER_REPLAYED].join(', ')})`, header, listed)
    }
    if (!unsafe && isSensitiveHeader(lower)) {
      throw new InvalidOptionError(name,
        'free of credential, cookie and security-policy headers (authorization, www-authenticate, authentication-info, cookie, ' +
        'strict-transport-security, content-security-policy, clear-site-data, alt-svc, access-control-*, ...): a replay would hand ' +
        'the original caller\'s value to whoever retries the key. List it in unsafeReplayHeaders to replay it anyway', header, listed)
    }
    if (unsafe && !isSensitiveHeader(lower)) {
      throw new InvalidOptionError(name, 'only credential, cookie or security-policy headers (an ordinary header belongs in replayHeaders)', header)
    }
    headers.add(lower)
  }
  return headers
}

/** A path of our own (no query, no fragment, no space) whose `:key` segment is the key. */
const STATUS_URL = /^\/[^\s?#]*$/

function resolveStatusRoute (value: unknown): StatusRouteSettings | null {
  if (value === undefined) return null
  let url: unknown = value
  let includeBody: unknown
  let name = 'option "statusRoute"'
  if (typeof value !== 'string') {
    if (value === null || typeof value !== 'object' || Array.isArray(value)) {
      throw new InvalidOptionError(name, "a path such as '/idempotency-keys/:key', or { url, includeBody }", value)
    }
    for (const member of Object.keys(value)) {
      if (member !== 'url' && member !== 'includeBody') throw new InvalidOptionError(`option "statusRoute.${member}"`, 'one of url, includeBody', (value as Record<string, unknown>)[member])
    }
    ({ url, includeBody } = value as Record<string, unknown>)
    name = 'option "statusRoute.url"'
  }
  if (typeof url !== 'string' || !STATUS_URL.test(url) || !url.split('/').includes(':key')) {
    throw new InvalidOptionError(name, "a path starting with / with a ':key' segment, such as '/idempotency-keys/:key'", url)
  }
  // The route is also declared as `<path before :key>/*` (lib/http/status-route.ts), so what follows the key must be static.
  const segments = url.split('/')
  if (url.includes('*') || segments.slice(segments.indexOf(':key') + 1).some((segment) => segment.includes(':'))) {
    throw new InvalidOptionError(name, "a path whose segments after ':key' are static, without '*'", url)
  }
  return Object.freeze({
    url,
    includeBody: booleanOption('option "statusRoute.includeBody"', includeBody, false)
  })
}
