import { parseTimestamp } from './node-postgres-types.js'

/**
 * A timestamptz column the driver reads (a message's or a record's created_at) as a Date, whatever
 * the client's type parsers made of it. postgres.js parses with one parser table per client, which
 * anything holding the client may change for all of it: Drizzle's postgres.js driver makes
 * timestamptz come back as its text on every client given to `drizzle()` (so it can map it
 * itself), and the outbox's delivery order then threw on a string, and `inspect()` and the
 * reconciler handed out strings typed as Dates. node-postgres needs none of this (the driver
 * passes its own parsers with each query), and its text is the same ISO form parsed here.
 */
export function asDate (value: unknown): Date {
  if (value instanceof Date) return value
  if (typeof value === 'string') return parseTimestamp(value)
  return new Date(Number.NaN)
}
