/**
 * The fake external payment provider (its own process, never faulted itself): it honours its own
 * Idempotency-Key as Stripe does (the same key and parameters replay the first charge, different
 * parameters get 422) and logs every call it receives, duplicates included, one JSON line each, to
 * CHAOS_PROVIDER_LOG. An executed line is an effect of lease mode; it carries the operation's scope
 * and key (as a real integration would put them in the charge's metadata), so the checker can count
 * charges per operation whatever provider key the app derived.
 *
 * Run as `node --import tsx test/chaos/provider.ts` with an IPC channel: it sends
 * `{ type: 'ready', port }` and exits when the channel closes (the harness went away).
 */
import { appendFileSync } from 'node:fs'
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http'
import type { AddressInfo } from 'node:net'
import { seededRandom } from './random.js'

export interface ProviderLogLine {
  readonly at: number
  readonly providerKey: string
  readonly outcome: 'executed' | 'replayed' | 'mismatch'
  readonly scope: string
  readonly key: string
  readonly amount: number
  /** The charge id: what the app's response must name. */
  readonly id: string
}

interface ChargeRequest { amount: number, currency: string, scope: string, key: string }

const logFile = process.env.CHAOS_PROVIDER_LOG
if (logFile === undefined || process.send === undefined) throw new Error('provider: CHAOS_PROVIDER_LOG and an IPC channel are required')
const random = seededRandom(Number(process.env.CHAOS_SEED ?? '1')).fork('provider')
/** The longest time between executing a charge and answering: the window in which the caller can die. */
const maxDelayMs = Number(process.env.CHAOS_PROVIDER_DELAY_MS ?? '40')

const charges = new Map<string, { parameters: string, id: string, body: string }>()
let sequence = 0

function log (line: ProviderLogLine): void {
  // Synchronous: a charge is logged before anyone can hear about it.
  appendFileSync(logFile as string, JSON.stringify(line) + '\n')
}

function answer (res: ServerResponse, status: number, body: string, headers: Record<string, string> = {}): void {
  res.writeHead(status, { 'content-type': 'application/json', ...headers })
  res.end(body)
}

function charge (req: IncomingMessage, res: ServerResponse, text: string): void {
  const providerKey = req.headers['idempotency-key']
  let parsed: ChargeRequest
  try {
    parsed = JSON.parse(text) as ChargeRequest
  } catch {
    answer(res, 400, '{"error":"invalid json"}')
    return
  }
  if (typeof providerKey !== 'string' || providerKey === '') {
    answer(res, 400, '{"error":"Idempotency-Key required"}')
    return
  }
  const parameters = JSON.stringify([parsed.amount, parsed.currency, parsed.scope, parsed.key])
  const existing = charges.get(providerKey)
  const line = { at: Date.now(), providerKey, scope: parsed.scope, key: parsed.key, amount: parsed.amount }
  if (existing !== undefined) {
    if (existing.parameters !== parameters) {
      log({ ...line, outcome: 'mismatch', id: existing.id })
      answer(res, 422, '{"error":"idempotency key reused with different parameters"}')
      return
    }
    log({ ...line, outcome: 'replayed', id: existing.id })
    answer(res, 201, existing.body, { 'idempotent-replayed': 'true' })
    return
  }
  const id = `ch_${++sequence}_${random.hex128().slice(0, 12)}`
  const body = JSON.stringify({ id, amount: parsed.amount, currency: parsed.currency })
  charges.set(providerKey, { parameters, id, body })
  log({ ...line, outcome: 'executed', id })
  // Executed now, answered a little later: a caller killed or cut off meanwhile never hears of it.
  setTimeout(() => answer(res, 201, body), random.int(0, maxDelayMs))
}

const server = createServer((req, res) => {
  const chunks: Buffer[] = []
  req.on('data', (chunk: Buffer) => chunks.push(chunk))
  req.on('end', () => {
    if (req.method === 'POST' && req.url === '/charges') charge(req, res, Buffer.concat(chunks).toString('utf8'))
    else answer(res, 404, '{"error":"not found"}')
  })
})
server.listen(0, '127.0.0.1', () => {
  process.send?.({ type: 'ready', port: (server.address() as AddressInfo).port })
})
process.on('disconnect', () => process.exit(0))
