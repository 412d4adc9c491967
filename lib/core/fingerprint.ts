import { createHash, hash, type Hash } from 'node:crypto'
import { Transform, type TransformCallback } from 'node:stream'
import { UNLIMITED, writeCanonical, type CanonicalLimits } from './fingerprint-canonical.js'
import type { Fingerprint } from './store.js'

/*
 * Algorithms are versioned: a record keeps the name of the algorithm that produced its fingerprint,
 * and a fingerprint made by another algorithm never compares equal (the answer is 422, never a
 * second execution). Bump the version whenever the bytes fed to the hash change.
 *
 * canonical-v1: SHA-256 over `METHOD \n target \n body`, where target is the request line's path and
 *   query as received and body is the parsed body in a canonical form close to RFC 8785 (JCS):
 *   object members sorted by UTF-16 code units, ECMAScript number serialisation, JSON string
 *   escaping; so `{"a":1,"b":2}` and `{ "b": 2, "a": 1 }` are one request. Bodies that are not
 *   JSON-like (a Buffer from an octet-stream parser, a string from text/plain) are tagged so they
 *   can never collide with a JSON value.
 * raw-v1: SHA-256 over `METHOD \n target \n` followed by the request body bytes as received
 *   (hashed while they stream in, before parsing): any byte of difference is a different request.
 * custom-v1: SHA-256 over the bytes the user's function returns.
 */
export const CANONICAL = 'canonical-v1'
export const RAW = 'raw-v1'
export const CUSTOM = 'custom-v1'

/** Bodies up to this size are hashed in one call: below it, a Hash object costs more than the copy. */
const ONE_SHOT_BYTES = 16 * 1024

/**
 * canonical-v1 of a request. Throws CanonicalLimitError when the parsed body is nested deeper or
 * holds more values than `limits` allow (lib/core/fingerprint-canonical.ts).
 */
export function canonicalFingerprint (method: string, url: string, body: unknown, contentType?: string, limits: CanonicalLimits = UNLIMITED): Fingerprint {
  const head = `${method}\n${url}\n`
  let digest: Buffer
  if (body === undefined) digest = hash('sha256', `${head}none`, 'buffer')
  else if (Buffer.isBuffer(body)) {
    digest = body.length <= ONE_SHOT_BYTES
      ? hash('sha256', Buffer.concat([Buffer.from(`${head}bytes:`), body]), 'buffer')
      : createHash('sha256').update(`${head}bytes:`).update(body).digest()
  // A string is text unless a JSON parser produced it (a JSON body `"x"`), which must not collide with text `x`.
  } else if (typeof body === 'string' && !isJson(contentType)) digest = hash('sha256', `${head}text:${body}`, 'buffer')
  else {
    // Hashed while it is written: a small body ends in one one-shot call, a large one in chunks.
    let running: Hash | null = null
    const rest = writeCanonical(body, limits, `${head}json:`, (chunk) => { (running ??= createHash('sha256')).update(chunk) })
    digest = running === null ? hash('sha256', rest, 'buffer') : (running as Hash).update(rest).digest()
  }
  return { algorithm: CANONICAL, digest }
}

function isJson (contentType: string | undefined): boolean {
  if (contentType === undefined) return false
  const semicolon = contentType.indexOf(';')
  const type = (semicolon === -1 ? contentType : contentType.slice(0, semicolon)).trim().toLowerCase()
  return type === 'application/json' || type.endsWith('+json')
}

export function customFingerprint (value: string | Buffer): Fingerprint {
  return { algorithm: CUSTOM, digest: hash('sha256', value, 'buffer') }
}

export function fingerprintsEqual (a: Fingerprint, b: Fingerprint): boolean {
  return a.algorithm === b.algorithm && a.digest.equals(b.digest)
}

/** Canonical JSON text of a parsed body (see canonical-v1 above). */
export function canonicalJson (value: unknown, limits: CanonicalLimits = UNLIMITED): string {
  const chunks: string[] = []
  const rest = writeCanonical(value, limits, '', (chunk) => { chunks.push(chunk) })
  chunks.push(rest)
  return chunks.join('')
}

/** Starts a raw-v1 hash; the body bytes are added by {@link hashingStream}. */
export function startRawHash (method: string, url: string): Hash {
  return createHash('sha256').update(method).update('\n').update(url).update('\n')
}

export function finishRawHash (hash: Hash): Fingerprint {
  return { algorithm: RAW, digest: hash.digest() }
}

/**
 * A pass-through that feeds every body chunk to `hash` as it streams to the body parser, so raw
 * mode neither buffers the body twice nor needs a second read of it.
 */
export function hashingStream (payload: NodeJS.ReadableStream & { receivedEncodedLength?: number }, hash: Hash): Transform {
  let received = 0
  const tap = new Transform({
    transform (chunk: Buffer, _encoding: BufferEncoding, callback: TransformCallback) {
      hash.update(chunk)
      received += chunk.length
      ;(tap as Transform & { receivedEncodedLength: number }).receivedEncodedLength = received
      callback(null, chunk)
    }
  })
  payload.on('error', (err: Error) => tap.destroy(err))
  return payload.pipe(tap)
}
