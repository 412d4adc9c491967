import type { FastifyRequest } from 'fastify'
import { EmptyScopeError } from '../core/errors.js'
import { isThenable } from '../core/thenable.js'

/** The principal that owns keys on a route (the `scope` option). */
export type ScopeFunction = (request: FastifyRequest) => string | Promise<string>

/** A lone surrogate (\p{Cs} in a u-mode pattern matches only unpaired ones) or NUL. */
const MALFORMED_SCOPE = /[\p{Cs}\0]/u

/**
 * The principal that owns the request's keys, as claims and the status route both read it. A lone
 * surrogate has no UTF-8 form: a driver that stores text as UTF-8 (Postgres) would turn '\ud800' and
 * '\udbff' into the same U+FFFD, merging two principals' keys (draft §5), and NUL has no place in a
 * text column. Refused loudly: a scope is the app's value, not the client's.
 */
export function scopeOf (scope: ScopeFunction | null, request: FastifyRequest): string | Promise<string> {
  if (scope === null) return ''
  const value: unknown = scope(request)
  // A synchronous scope function stays synchronous: no promise, no extra tick on every request.
  return isThenable(value) ? Promise.resolve(value).then(checkScope) : checkScope(value)
}

function checkScope (value: unknown): string {
  if (typeof value !== 'string') {
    throw new TypeError(`fastify-idempotency: the scope function must return a string; it returned ${value === null ? 'null' : typeof value}`)
  }
  if (MALFORMED_SCOPE.test(value)) {
    throw new TypeError('fastify-idempotency: the scope function returned a string with a lone surrogate or a NUL character; scopes must be well-formed text (encode binary ids, e.g. as hex)')
  }
  return value
}

/**
 * The app's scope function, refusing `''` unless the app asked for it: an auth hook that did not
 * run, or a header that was not sent, would otherwise put every such caller in one key space,
 * where one can replay or block another's operation (draft §5). Synchronous functions stay so.
 */
export function refuseEmptyScope (scope: ScopeFunction, allowEmpty: boolean): ScopeFunction {
  if (allowEmpty) return scope
  const check = (value: string): string => {
    if (value === '') throw new EmptyScopeError()
    return value
  }
  return function scopeNotEmpty (request) {
    const value = scope(request)
    // Not a string: a promise (or a wrong type, which scopeOf reports as it always did).
    return typeof value === 'string' ? check(value) : Promise.resolve(value).then(check)
  }
}
