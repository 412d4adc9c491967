/*
 * The canonical form of a parsed body (canonical-v1, lib/core/fingerprint.ts), written by one iterative
 * walk that hands its text out in chunks, so the caller can hash while it walks.
 *
 * Why iterative: the recursive version used one JS stack frame per level of nesting, so an 8 KiB
 * body nested about 4,000 levels deep threw "Maximum call stack size exceeded" (a 500) where the
 * same body without a key ran. Here the nesting lives in an explicit stack of frames, and both the
 * depth and the number of values are bounded (CanonicalLimits), each refusal answered as a client
 * error before the handler runs (lib/fastify/claim.ts).
 *
 * Why chunks: building the whole text and hashing it once cost about 5x JSON.parse of the same
 * body (1 MiB flat array); the chunks are hashed as they fill (benchmarks/fingerprint.ts).
 *
 * The bytes are exactly those of the recursive version, which stored records were made with
 * (test/fingerprint/canonical.test.ts compares the two on generated and hand-picked values).
 */

export interface CanonicalLimits {
  /** Containers (objects, arrays) nested in one another; a scalar body has depth 0. */
  readonly maxDepth: number
  /** Values walked (every scalar, container and toJSON result counts one). */
  readonly maxNodes: number
}

export const UNLIMITED: CanonicalLimits = Object.freeze({ maxDepth: Infinity, maxNodes: Infinity })

/** A body beyond one of the route's limits: answered 400 (depth) or 413 (nodes), never walked further. */
export class CanonicalLimitError extends Error {
  constructor (readonly limit: 'depth' | 'nodes', readonly max: number) {
    super(limit === 'depth'
      ? `fastify-idempotency: the request body is nested deeper than ${max} levels (option maxBodyDepth)`
      : `fastify-idempotency: the request body holds more than ${max} values (option maxBodyNodes)`)
    this.name = 'CanonicalLimitError'
  }
}

/**
 * Characters JSON.stringify escapes in a string: `"`, `\`, C0 controls, and surrogates (a lone one
 * is written as \udxxx since ES2019's well-formed JSON.stringify; a pair is written as it is, but
 * such a string is rare enough to leave to JSON.stringify). A string without any is written as
 * `"` + itself + `"`, which is what JSON.stringify would give, without its call.
 */
// eslint-disable-next-line no-control-regex -- the controls JSON must escape (RFC 8259 §7)
const NEEDS_ESCAPE = /["\\\u0000-\u001f\ud800-\udfff]/

function quote (text: string): string {
  return NEEDS_ESCAPE.test(text) ? JSON.stringify(text) : `"${text}"`
}

/** Characters of text handed to `flush` at a time: large enough to amortise a Hash#update call. */
const CHUNK_CHARS = 1 << 15

/** One open container: an array (`keys` null) or an object (`keys` its sorted member names). */
interface Frame {
  array: readonly unknown[] | null
  object: Record<string, unknown> | null
  keys: string[] | null
  index: number
  first: boolean
}

/**
 * Writes `prefix` and the canonical text of `root`: every full chunk goes to `flush`, and the
 * rest (at most about CHUNK_CHARS characters) is returned. Throws CanonicalLimitError past a limit.
 *
 * The rules, each what the recursive version did (and so what stored records hold):
 * - object members sorted by UTF-16 code units (Array#sort's default), undefined members left out;
 * - arrays in order, a member without a JSON value (undefined, a function, a symbol) written null;
 * - numbers and strings as JSON.stringify writes them (non-finite numbers are null);
 * - a Buffer as the JSON string of its base64; an object with toJSON as what toJSON returns;
 * - any other object by its own enumerable string-keyed members (a boxed primitive is `{}`).
 */
export function writeCanonical (root: unknown, limits: CanonicalLimits, prefix: string, flush: (chunk: string) => void): string {
  const { maxDepth, maxNodes } = limits
  // Frames are reused by depth: a wide body of small objects allocates one per level, not per object.
  const frames: Frame[] = []
  let depth = 0
  let nodes = 0
  let out = prefix
  let value = root
  const names = new Map<string, string>()
  for (;;) {
    // Write `value`.
    for (;;) {
      if (++nodes > maxNodes) throw new CanonicalLimitError('nodes', maxNodes)
      if (typeof value === 'string') {
        out += quote(value)
      } else if (typeof value === 'number') {
        // Number::toString, which JSON.stringify uses for every finite number (-0 is "0").
        out += Number.isFinite(value) ? String(value) : 'null'
      } else if (value === null || typeof value !== 'object') {
        // Booleans; a bigint throws (with toJSON, what it returns) as JSON.stringify does.
        out += JSON.stringify(value) ?? 'null'
      } else if (Array.isArray(value)) {
        if (depth === maxDepth) throw new CanonicalLimitError('depth', maxDepth)
        if (isFlatArray(value)) {
          // Every member a scalar: JSON.stringify writes the same text (scalars as above, a
          // member without a JSON value as null), in one native call.
          nodes += value.length
          if (nodes > maxNodes) throw new CanonicalLimitError('nodes', maxNodes)
          out += JSON.stringify(value)
        } else {
          open(frames, depth++, value, null, null)
          out += '['
        }
      } else if (Buffer.isBuffer(value)) {
        // Base64 has no character JSON escapes.
        out += `"${value.toString('base64')}"`
      } else if (typeof (value as { toJSON?: unknown }).toJSON === 'function') {
        value = (value as { toJSON: () => unknown }).toJSON()
        continue
      } else {
        if (depth === maxDepth) throw new CanonicalLimitError('depth', maxDepth)
        const object = value as Record<string, unknown>
        const keys = Object.keys(object)
        const shape = objectShape(object, keys)
        if (shape === FLAT_SORTED) {
          // Members already in canonical order and every value a JSON scalar: JSON.stringify
          // writes them in that (own property) order, with the same text, in one native call.
          nodes += keys.length
          if (nodes > maxNodes) throw new CanonicalLimitError('nodes', maxNodes)
          out += JSON.stringify(object)
        } else {
          open(frames, depth++, null, object, shape === SORTED ? keys : keys.sort())
          out += '{'
        }
      }
      break
    }
    if (out.length >= CHUNK_CHARS) {
      flush(out)
      out = ''
    }

    // Find the next value, closing the containers that are done.
    let found = false
    while (depth > 0) {
      const frame = frames[depth - 1] as Frame
      const array = frame.array
      if (array !== null) {
        const index = frame.index
        if (index < array.length) {
          frame.index = index + 1
          if (index > 0) out += ','
          value = array[index]
          found = true
          break
        }
        out += ']'
      } else {
        const object = frame.object as Record<string, unknown>
        const keys = frame.keys as string[]
        while (frame.index < keys.length) {
          const name = keys[frame.index++] as string
          const member = object[name]
          if (member === undefined) continue
          let quoted = names.get(name)
          if (quoted === undefined) {
            quoted = quote(name) + ':'
            if (names.size < 4096) names.set(name, quoted)
          }
          out += frame.first ? quoted : ',' + quoted
          frame.first = false
          value = member
          found = true
          break
        }
        if (found) break
        out += '}'
      }
      // Nothing kept alive by a finished frame.
      frame.array = null
      frame.object = null
      frame.keys = null
      depth--
    }
    if (!found) return out
  }
}

/** An array JSON.stringify writes canonically: no toJSON of its own, no object member. */
function isFlatArray (array: readonly unknown[]): boolean {
  if (typeof (array as { toJSON?: unknown }).toJSON === 'function') return false
  for (let i = 0; i < array.length; i++) {
    const member = array[i]
    // A bigint is left to the walk, which throws or uses its toJSON as JSON.stringify would.
    if ((typeof member === 'object' && member !== null) || typeof member === 'bigint') return false
  }
  return true
}

const UNSORTED = 0
const SORTED = 1
const FLAT_SORTED = 2

/**
 * Whether an object's own keys are already sorted by code units (then they need no sort), and
 * whether JSON.stringify would also write it canonically (FLAT_SORTED): a plain object, its keys
 * sorted (JSON.stringify follows the Object.keys order, integer-like keys first), and every member
 * a string, number, boolean, null or undefined (JSON.stringify leaves undefined out, as the walk
 * does; it would also leave out a function or symbol member, which the walk writes as null).
 */
function objectShape (object: Record<string, unknown>, keys: readonly string[]): number {
  let flat = true
  let previous = ''
  for (let i = 0; i < keys.length; i++) {
    const name = keys[i] as string
    if (i > 0 && !(previous < name)) return UNSORTED
    previous = name
    if (flat) {
      const member = object[name]
      const type = typeof member
      if (type === 'object' ? member !== null : type !== 'string' && type !== 'number' && type !== 'boolean' && type !== 'undefined') flat = false
    }
  }
  if (!flat) return SORTED
  const prototype: unknown = Object.getPrototypeOf(object)
  return prototype === Object.prototype || prototype === null ? FLAT_SORTED : SORTED
}

function open (frames: Frame[], at: number, array: readonly unknown[] | null, object: Record<string, unknown> | null, keys: string[] | null): void {
  const frame = frames[at]
  if (frame === undefined) {
    frames.push({ array, object, keys, index: 0, first: true })
    return
  }
  frame.array = array
  frame.object = object
  frame.keys = keys
  frame.index = 0
  frame.first = true
}
