import { hash } from 'node:crypto'

/*
 * canonical-v1 written the plainest way, recursively: the oracle lib/core/fingerprint.ts's iterative walk
 * must match byte for byte (test/fingerprint/canonical.test.ts and `npm run bench:fingerprint` check
 * it: a changed byte would make every stored record answer its retries 422).
 */

export function referenceJson (value: unknown): string {
  if (value === null || typeof value !== 'object') {
    return JSON.stringify(value) ?? 'null'
  }
  if (Array.isArray(value)) {
    let out = '['
    for (let i = 0; i < value.length; i++) out += (i === 0 ? '' : ',') + referenceJson(value[i])
    return out + ']'
  }
  if (Buffer.isBuffer(value)) return JSON.stringify(value.toString('base64'))
  const withToJSON = value as { toJSON?: () => unknown }
  if (typeof withToJSON.toJSON === 'function') return referenceJson(withToJSON.toJSON())
  const record = value as Record<string, unknown>
  const names = Object.keys(record).sort()
  let out = '{'
  let first = true
  for (const name of names) {
    const member = record[name]
    if (member === undefined) continue
    out += (first ? '' : ',') + JSON.stringify(name) + ':' + referenceJson(member)
    first = false
  }
  return out + '}'
}

/** The reference's canonicalFingerprint digest for a JSON request (content type application/json). */
export function referenceDigest (method: string, url: string, body: unknown): Buffer {
  const head = `${method}\n${url}\n`
  if (body === undefined) return hash('sha256', `${head}none`, 'buffer')
  if (Buffer.isBuffer(body)) return hash('sha256', Buffer.concat([Buffer.from(`${head}bytes:`), body]), 'buffer')
  return hash('sha256', `${head}json:${referenceJson(body)}`, 'buffer')
}
