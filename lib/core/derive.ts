import { createHash } from 'node:crypto'

/** Longest step or downstream-call name, in UTF-16 code units: a name is code, not data. */
export const MAX_NAME_LENGTH = 200

/**
 * The key a downstream call carries (a card network's or an email provider's own idempotency key),
 * derived from (scope, key, name) only, so every attempt of the operation (a retry, a takeover after
 * a crash, the reconciler) derives the same one and a provider that honours idempotency keys executes
 * the call at most once, whoever makes it. Different names, keys or scopes never share one: the
 * three parts are length-prefixed before hashing, so no two triples encode the same bytes.
 *
 * SHA-256 in base64url: 43 characters of [A-Za-z0-9_-], inside every provider's key limits (Stripe
 * allows 255) and no clue to the client's key for whoever reads the provider's logs.
 */
export function deriveKey (scope: string, key: string, name: string): string {
  checkName('deriveKey', name)
  const hash = createHash('sha256').update('fastify-idempotency:derived-key:v1\0')
  for (const part of [scope, key, name]) {
    const bytes = Buffer.from(part, 'utf8')
    const length = Buffer.allocUnsafe(4)
    length.writeUInt32BE(bytes.length)
    hash.update(length).update(bytes)
  }
  return hash.digest('base64url')
}

export function checkName (caller: string, name: unknown): asserts name is string {
  if (typeof name !== 'string' || name.length === 0 || name.length > MAX_NAME_LENGTH) {
    throw new TypeError(`fastify-idempotency: ${caller}(name) takes a non-empty string of at most ${MAX_NAME_LENGTH} characters; received ${typeof name === 'string' ? `a string of ${name.length}` : typeof name}`)
  }
}
