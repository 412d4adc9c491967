import { HELD_MIN_MS, scenarioOfKey } from './scenario-routes.js'

/**
 * The payments app's decision for a record left in progress (the reconciliation process: "a
 * reconciliation process resolves records left in in_progress beyond a timeout"): when the charge
 * step completed, record the response the handler would have sent, byte for byte (the same JSON
 * from the same charge, as app.ts builds it); otherwise resume, so the next retry runs the handler
 * again, and its derived provider key replays a charge that did happen.
 *
 * A record held by the `held` scenario (an indeterminate failure after its charge) is left alone
 * until HELD_MIN_MS after it was created, longer than its route's ttl: retries meanwhile must get
 * 409, never a new execution.
 */

export interface StuckRecordView {
  readonly scope: string
  readonly key: string
  readonly steps: Readonly<Record<string, unknown>>
  readonly createdAt?: Date
  readonly indeterminate?: boolean
}

export type Resolution =
  | { action: 'complete', response: { statusCode: number, headers: Record<string, string>, body: string } }
  | { action: 'resume' }
  | { action: 'leave' }

export function resolveStuck (record: StuckRecordView, now = Date.now()): Resolution {
  if (scenarioOfKey(record.key) === 'held' && record.createdAt !== undefined && record.createdAt.getTime() + HELD_MIN_MS > now) {
    return { action: 'leave' }
  }
  const charge = record.steps.charge as { id?: unknown, amount?: unknown } | undefined
  if (charge !== undefined && charge !== null && typeof charge.id === 'string' && typeof charge.amount === 'number') {
    const body = JSON.stringify({ mode: 'lease', scope: record.scope, key: record.key, amount: charge.amount, ref: charge.id })
    return { action: 'complete', response: { statusCode: 201, headers: { 'content-type': 'application/json; charset=utf-8' }, body } }
  }
  return { action: 'resume' }
}
