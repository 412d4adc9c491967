import type { Fingerprint, Lease, RecordId, StoredResponse } from '../../lib/store.js'
import type { TransactionSql } from 'postgres'
import type { PostgresClient, ResolvedNames } from './options.js'

/*
 * Every statement the lease mode runs, one short statement each, in autocommit (no transaction is
 * ever held across a request). Shared rules:
 *
 * - Every time comes from the DATABASE clock: a duration in ms is bound as a parameter and added to
 *   now(), so instances whose clocks disagree still agree on leases and expiry. now() is STABLE and
 *   is evaluated once per statement, so a statement sees one consistent "now".
 * - Every statement names `scope = $` in its WHERE and touches one (scope, key) row (the purge
 *   excepted), so on Citus it routes to a single shard (citus-notes: works unchanged; 6). No
 *   volatile function appears in an UPDATE or DELETE (citus-notes 2): tokens are app-generated.
 * - A conditional UPDATE/DELETE repeats in its WHERE every condition it relies on. Under READ
 *   COMMITTED, a statement that waited for a concurrent writer re-checks its WHERE against the
 *   row's new version (EvalPlanQual), so exactly one of several racing statements matches.
 * - Results are read positionally (`.values()`), so a client created with a column-name transform
 *   (postgres.camel, postgres.pascal, ...) reads the same columns.
 * - postgres.js prepares every statement (named, once per connection): after the first use on a
 *   connection, each call is a single round trip (Bind/Execute/Sync).
 */

/** What the claim statement saw when its insert did nothing: the row as of the statement's snapshot. */
export interface ExistingRecord {
  readonly state: 'in_progress' | 'completed'
  readonly fingerprint: Fingerprint
  readonly token: string
  /** expires_at <= now(): the record is past its ttl and may be reclaimed by any request. */
  readonly expired: boolean
  /** lease_expires_at <= now(): an in-progress owner stopped renewing. */
  readonly lapsed: boolean
  readonly leaseRemainingMs: number
  readonly response: StoredResponse | null
}

/** `acquired`: the insert created the record; `existing`: it did not; null: it did not and the row is not in the snapshot. */
export type ClaimStatementResult = { readonly acquired: true } | { readonly acquired: false, readonly record: ExistingRecord } | null

export interface ClaimArgs extends RecordId {
  readonly fingerprint: Fingerprint
  readonly token: string
  readonly leaseMs: number
  readonly ttlMs: number
}

export interface Statements {
  claim (args: ClaimArgs): Promise<ClaimStatementResult>
  reclaim (args: ClaimArgs, seenToken: string): Promise<boolean>
  takeover (args: ClaimArgs, seenToken: string): Promise<boolean>
  complete (lease: Lease, response: StoredResponse, ttlMs: number): Promise<boolean>
  release (lease: Lease): Promise<boolean>
  renew (lease: Lease, leaseMs: number): Promise<boolean>
  get (id: RecordId): Promise<ExistingRecord | null>
  purge (limit: number): Promise<number>
}

type Headers = StoredResponse['headers']

/** Columns of the claim and get statements, in SELECT order. */
type RecordColumns = [
  state: 'in_progress' | 'completed', algorithm: string, digest: Buffer, token: string, expired: boolean,
  lapsed: boolean | null, remaining: number, status: number | null, headers: Headers | null, body: Buffer | null
]
type ClaimColumns = [acquired: boolean, ...RecordColumns]

/** `sql` is the pooled client (lease mode) or a transaction's handle (atomic mode). */
export function createStatements (sql: PostgresClient | TransactionSql<any>, names: ResolvedNames): Statements {
  const table = (): ReturnType<typeof sql> => sql`${sql(names.schema)}.${sql(names.table)}`
  const later = (ms: number): ReturnType<typeof sql> => sql`now() + ${ms}::float8 * interval '1 millisecond'`
  // The record's columns as RecordColumns lists them. The lease's remaining time is computed by the
  // database (0 once lapsed; ceil so that it is 0 exactly when lease_expires_at <= now()). The body
  // of an expired record is not fetched: it is about to be replaced.
  const recordColumns = (): ReturnType<typeof sql> => sql`
    state, fingerprint_algorithm, fingerprint, owner_token::text, expires_at <= now(), lease_expires_at <= now(),
    greatest(0, ceil(extract(epoch FROM lease_expires_at - now()) * 1000))::float8,
    response_status, response_headers, CASE WHEN expires_at > now() THEN response_body END`

  return {
    // The fresh-key path in ONE statement: the insert claims the key, or (ON CONFLICT DO NOTHING)
    // changes nothing and the second branch reads the row that is in the way. Both branches share
    // the statement's snapshot, so the read cannot see the row this statement inserted: NOT EXISTS
    // keeps it from also returning a row deleted concurrently. If the conflicting row was
    // committed after the snapshot was taken (the insert waited for its inserter), the read sees
    // nothing and the result is null: the caller runs the statement again with a new snapshot.
    // DO NOTHING, never DO UPDATE: on Citus its SET/WHERE allow immutable expressions only (citus-notes 1).
    async claim (args) {
      const rows = await sql`
        WITH claimed AS (
          INSERT INTO ${table()} (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, lease_expires_at, expires_at)
          VALUES (${args.scope}, ${args.key}, ${args.fingerprint.digest}, ${args.fingerprint.algorithm}, 'in_progress',
                  ${args.token}, ${later(args.leaseMs)}, ${later(args.ttlMs)})
          ON CONFLICT (scope, key) DO NOTHING
          RETURNING true AS acquired
        )
        SELECT acquired, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM claimed
        UNION ALL
        SELECT false, ${recordColumns()}
        FROM ${table()}
        WHERE scope = ${args.scope} AND key = ${args.key} AND NOT EXISTS (SELECT FROM claimed)
      `.values()
      const row = rows[0] as ClaimColumns | undefined
      if (row === undefined) return null
      if (row[0]) return { acquired: true }
      const [, ...record] = row
      return { acquired: false, record: recordOf(record) }
    },

    // A record past its ttl is dead: any request reclaims it as a fresh one (takeover: false). The
    // token seen by the claim statement pins the row version, so two reclaimers cannot both win.
    async reclaim (args, seenToken) {
      const result = await sql`
        UPDATE ${table()}
        SET fingerprint = ${args.fingerprint.digest}, fingerprint_algorithm = ${args.fingerprint.algorithm},
            state = 'in_progress', owner_token = ${args.token},
            lease_expires_at = ${later(args.leaseMs)}, expires_at = ${later(args.ttlMs)}, created_at = now(),
            response_status = NULL, response_headers = NULL, response_body = NULL
        WHERE scope = ${args.scope} AND key = ${args.key} AND owner_token = ${seenToken} AND expires_at <= now()
      `
      return result.count === 1
    },

    // An in-progress record whose owner stopped renewing, retried with the same request: handed to
    // a new token (the old one stops working: complete/release/renew are fenced by it). The record
    // lives at least a ttl from now, as a newly created one would.
    async takeover (args, seenToken) {
      const result = await sql`
        UPDATE ${table()}
        SET owner_token = ${args.token}, lease_expires_at = ${later(args.leaseMs)},
            expires_at = greatest(expires_at, ${later(args.ttlMs)})
        WHERE scope = ${args.scope} AND key = ${args.key} AND owner_token = ${seenToken}
          AND state = 'in_progress' AND lease_expires_at <= now() AND expires_at > now()
          AND fingerprint_algorithm = ${args.fingerprint.algorithm} AND fingerprint = ${args.fingerprint.digest}
      `
      return result.count === 1
    },

    // Fenced by the token, not by time: an owner whose lease lapsed but was not taken over still
    // records its outcome (the effect happened; recording it is what stops a second execution).
    async complete (lease, response, ttlMs) {
      const result = await sql`
        UPDATE ${table()}
        SET state = 'completed', response_status = ${response.statusCode},
            response_headers = ${sql.json(response.headers)}::jsonb, response_body = ${response.body},
            lease_expires_at = NULL, expires_at = ${later(ttlMs)}
        WHERE scope = ${lease.scope} AND key = ${lease.key} AND owner_token = ${lease.token} AND state = 'in_progress'
      `
      return result.count === 1
    },

    async release (lease) {
      const result = await sql`
        DELETE FROM ${table()}
        WHERE scope = ${lease.scope} AND key = ${lease.key} AND owner_token = ${lease.token} AND state = 'in_progress'
      `
      return result.count === 1
    },

    // The record is kept at least until the lease ends: a handler running longer than the ttl must
    // not have its in-progress record expire (and be reclaimed by a retry) while it still renews.
    async renew (lease, leaseMs) {
      const result = await sql`
        UPDATE ${table()}
        SET lease_expires_at = ${later(leaseMs)}, expires_at = greatest(expires_at, ${later(leaseMs)})
        WHERE scope = ${lease.scope} AND key = ${lease.key} AND owner_token = ${lease.token} AND state = 'in_progress'
      `
      return result.count === 1
    },

    async get (id) {
      const rows = await sql`
        SELECT ${recordColumns()}
        FROM ${table()}
        WHERE scope = ${id.scope} AND key = ${id.key} AND expires_at > now()
      `.values()
      const row = rows[0] as RecordColumns | undefined
      return row === undefined ? null : recordOf(row)
    },

    // The portable bounded form (citus-notes 3: no ctid batches, no multi-shard SKIP LOCKED), with
    // `expires_at <= now()` repeated on the outer DELETE. Without it, a record reclaimed by a
    // concurrent claim after the subquery picked it would still be deleted: EvalPlanQual re-checks
    // the DELETE's own conditions on the new row version, not the subquery's, so the live record
    // of a new owner would vanish (and a retry would execute a second time).
    async purge (limit) {
      const result = await sql`
        DELETE FROM ${table()}
        WHERE expires_at <= now()
          AND (scope, key) IN (SELECT scope, key FROM ${table()} WHERE expires_at <= now() LIMIT ${limit})
      `
      return result.count
    }
  }
}

function recordOf (columns: RecordColumns): ExistingRecord {
  const [state, algorithm, digest, token, expired, lapsed, remaining, status, headers, body] = columns
  return {
    state,
    fingerprint: { algorithm, digest },
    token,
    expired,
    lapsed: lapsed === true,
    leaseRemainingMs: remaining,
    response: state === 'completed' && status !== null ? { statusCode: status, headers: headers ?? {}, body } : null
  }
}
