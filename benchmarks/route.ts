/**
 * The benchmark's route, the same in every setup (server.ts, memory.ts): POST /pay with a JSON body
 * schema, answering 201 with a JSON payment and no response schema, so that every setup does the
 * same Fastify work (parse, validate, serialise, send) and the differences are the idempotency layer's.
 */
import { createHash } from 'node:crypto'

export interface PayBody { amount: number, currency: string }

/** The request body every benchmark sends (valid against PAY_SCHEMA). */
export const BODY = '{"amount":1000,"currency":"EUR"}'

/** amount an integer, currency three capital letters, nothing else. */
export const PAY_SCHEMA = {
  body: { type: 'object', required: ['amount', 'currency'], properties: { amount: { type: 'integer' }, currency: { type: 'string', pattern: '^[A-Z]{3}$' } }, additionalProperties: false }
} as const

/** ~200 bytes of JSON, the same shape in every setup; `id` is padded so its length does not vary. */
export function basePayment (id: number | string, body: PayBody): Record<string, unknown> {
  const n = String(id).padStart(12, '0')
  return { id: `pay_${n}`, object: 'payment', status: 'succeeded', amount: body.amount, currency: body.currency, description: `benchmark payment ${n}`, livemode: false, created: Math.floor(Date.now() / 1000), receipt: `rcpt_${n}` }
}

/**
 * The padding that brings the payment's JSON to `bytes` (null at 200 or below: the bare payment).
 * Base64 of a fixed pseudo-random stream (SHAKE-256 of a constant), so every setup and run sends
 * the same text and PostgreSQL's TOAST compression cannot shrink it the way it shrinks a run of
 * one letter: a 1 MiB response stores 1 MiB.
 */
export function padding (bytes: number): string | null {
  const sample = { ...basePayment(0, { amount: 1000, currency: 'EUR' }), padding: '' }
  const missing = bytes - JSON.stringify(sample).length
  if (bytes <= 200 || missing <= 0) return null
  return createHash('shake256', { outputLength: Math.ceil(missing * 3 / 4) + 3 }).update('fastify-idempotency benchmark').digest('base64').slice(0, missing)
}

/** The payment answered for `id`, padded with `pad` (from padding()) when it is not null. */
export function payment (id: number | string, body: PayBody, pad: string | null): Record<string, unknown> {
  const base = basePayment(id, body)
  if (pad !== null) base.padding = pad
  return base
}
