/**
 * What an option error says about the value it refuses: its kind, never its content. The value of
 * a misplaced option is often a client or a string that carries credentials (a postgres.js client's
 * `options.pass`, a pg.Pool's `connectionString`, a URL with a user and password, a bearer token, a
 * key), and an error message travels to logs, crash reports and issue trackers. So a string is
 * described by its length and an object by its kind (the database and Redis clients by name, a
 * plain object by its property names); numbers, booleans, null and undefined carry nothing secret
 * and are shown as they are.
 *
 * Every option error of the package describes its value here: the plugin's and the drivers'
 * (`InvalidOptionError` of lib/core/errors.ts) and the client's (client/errors.ts). It lives in client/
 * and imports nothing, because the client entry point stands alone (no Fastify, nothing from lib/).
 */
export function describeValue (value: unknown): string {
  if (value === undefined || value === null || typeof value === 'number' || typeof value === 'boolean') return String(value)
  if (typeof value === 'bigint') return `${value}n`
  if (typeof value === 'string') return `a string of ${count(value.length, 'character')}`
  if (typeof value === 'symbol') return 'a symbol'
  if (typeof value === 'function') return isPostgresJsClient(value) ? 'a postgres.js client' : 'a function'
  if (typeof value !== 'object') return `a ${typeof value}`
  if (Array.isArray(value)) return describeArray(value)
  if (ArrayBuffer.isView(value)) return `a ${className(value) ?? 'typed array'} of ${count(value.byteLength, 'byte')}`
  const client = knownClient(value)
  if (client !== null) return client
  const name = className(value)
  if (name !== null) return `an instance of ${name}`
  return describeObject(value)
}

/** postgres.js's `sql`: a function with `begin` and `unsafe` (and `options`, which holds `pass`). */
function isPostgresJsClient (value: Function): boolean {
  const candidate = value as unknown as Record<string, unknown>
  return typeof candidate.begin === 'function' && typeof candidate.unsafe === 'function'
}

/** node-postgres's Pool, Client and PoolClient, and ioredis's Redis and Cluster, by their shapes. */
function knownClient (value: object): string | null {
  const candidate = value as Record<string, unknown>
  if (typeof candidate.query === 'function' && typeof candidate.connect === 'function') {
    if ('totalCount' in candidate && 'idleCount' in candidate) return 'a pg.Pool'
    if (typeof candidate.release === 'function') return 'a pg.PoolClient'
    if (className(value) === 'Client') return 'a pg.Client'
  }
  if (typeof candidate.defineCommand === 'function' && typeof candidate.hgetallBuffer === 'function') {
    return className(value) === 'Cluster' ? 'an ioredis Cluster' : 'an ioredis Redis client'
  }
  return null
}

/** The name of an object's class, or null for a plain object (or one whose class has no usable name). */
function className (value: object): string | null {
  const prototype: unknown = Object.getPrototypeOf(value)
  if (prototype === null || prototype === Object.prototype) return null
  const name: unknown = (value as { constructor?: { name?: unknown } }).constructor?.name
  return typeof name === 'string' && IDENTIFIER.test(name) ? name : null
}

const IDENTIFIER = /^[A-Za-z_$][\w$]{0,63}$/
/** A property name shown as it is: an option's name, never anything that could be data. */
const PROPERTY = /^[A-Za-z_$][\w$-]{0,39}$/
const MAX_LISTED = 10

/** A plain object by its property names (they name options, not values), when they look like names. */
function describeObject (value: object): string {
  const names = Object.keys(value)
  if (names.length === 0) return 'an object with no properties'
  if (names.length > MAX_LISTED || !names.every((name) => PROPERTY.test(name))) return `an object with ${count(names.length, 'property', 'properties')}`
  return `an object with ${names.length === 1 ? 'property' : 'properties'} ${names.join(', ')}`
}

/** An array by its length; a short one of numbers (a list of statuses) also by its items. */
function describeArray (value: readonly unknown[]): string {
  const shown = value.length > 0 && value.length <= MAX_LISTED && value.every((item) => typeof item === 'number' && Number.isFinite(item))
  return `an array of ${count(value.length, 'item')}${shown ? `: ${value.join(', ')}` : ''}`
}

function count (n: number, one: string, many = `${one}s`): string {
  return `${n} ${n === 1 ? one : many}`
}
