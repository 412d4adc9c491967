import { createHash } from 'node:crypto'

/**
 * The provider's idempotency key for an operation's charge: the same for every attempt of the
 * operation (a retry on another instance, a takeover after a crash), so the provider executes the
 * charge at most once whoever calls it (draft §2.1's guarantee carried one hop downstream).
 * Fallback for stores without `request.idempotency.deriveKey(name)`; the app prefers that.
 */
export function providerKeyFor (scope: string, key: string, name: string): string {
  const hash = createHash('sha256')
  for (const part of [scope, key, name]) hash.update(`${Buffer.byteLength(part)}:${part};`)
  return hash.digest('base64url')
}
