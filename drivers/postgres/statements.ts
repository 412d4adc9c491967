import { createHash } from 'node:crypto'
import type { ClaimResult, Fingerprint, Lease, RecordId, StoredResponse } from '../../lib/core/store.js'
import { MARK_SETTING, type Queryable, type Value } from './client.js'

/*
 * Every statement the lease mode runs, one short statement each, in autocommit (no transaction is
 * ever held across a request). Shared rules:
 *
 * - Every time comes from the DATABASE clock: a duration in ms is bound as a parameter and added to
 *   now(), so instances whose clocks disagree still agree on leases and expiry. now() is STABLE and
 *   is evaluated once per statement, so a statement sees one consistent "now".
 * - Every statement names `scope = $` in its WHERE and touches one (scope, key) row (the purge
 *   excepted), so on Citus it routes to a single shard (and Citus wants `scope = …` on every row
 *   lock). No volatile function appears in an UPDATE or DELETE (Citus refuses them there): tokens
 *   are app-generated.
 * - A conditional UPDATE/DELETE repeats in its WHERE every condition it relies on. Under READ
 *   COMMITTED, a statement that waited for a concurrent writer re-checks its WHERE against the
 *   row's new version (EvalPlanQual), so exactly one of several racing statements matches.
 * - Results are read positionally (client.ts), whichever client runs them.
 * - Every statement's text is fixed (built once per createStatements) and prepared by the client
 *   (named, once per connection): after the first use on a connection, each call is a single
 *   round trip (Bind/Execute/Sync) that only binds values.
 */

/** What the claim statement saw when its insert did nothing: the row as of the statement's snapshot. */
export interface ExistingRecord {
  readonly state: 'in_progress' | 'completed'
  readonly fingerprint: Fingerprint
  readonly token: string
  /** expires_at <= now(): the record is past its ttl and may be reclaimed by any request. */
  readonly expired: boolean
  /**
   * lease_expires_at <= now() and not held for the reconciler: an in-progress owner stopped renewing,
   * so a retry of the same request may take the record over.
   */
  readonly lapsed: boolean
  readonly leaseRemainingMs: number
  /** Milliseconds until expires_at (0 once expired), so a pre-filter's copy never outlives the record. */
  readonly expiresInMs: number
  readonly response: StoredResponse | null
}

/** The answer a record in the way gives a claim, in either mode: its replay when it is completed, otherwise in progress. */
export function answerFrom (record: ExistingRecord): ClaimResult {
  return record.state === 'completed' && record.response !== null
    ? { outcome: 'completed', fingerprint: record.fingerprint, response: record.response, expiresInMs: record.expiresInMs }
    : { outcome: 'in_progress', fingerprint: record.fingerprint, leaseRemainingMs: record.leaseRemainingMs }
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

/**
 * Atomic mode's statements (transaction.ts), run inside the request's transaction. The claim,
 * reclaim and takeover write the record already HELD for the reconciler (`indeterminate`, lease
 * ended, never expiring: what recovery.ts `hold` writes), and `complete` makes it an ordinary
 * completed record. Nobody sees the row before the transaction commits, so a request that ends
 * normally never shows the held state; but a transaction committed early by the handler itself
 * (a COMMIT through `request.idempotency.sql`), however little runs after that (the process may
 * die right then), leaves a record that no retry takes over or reclaims, and that the reconciler
 * resolves, instead of one whose lease a retry takes over to run the operation a second time.
 */
export interface AtomicStatements {
  claim (args: AtomicClaimArgs): Promise<AtomicClaimResult>
  reclaim (args: AtomicClaimArgs, seenToken: string): Promise<boolean>
  takeover (args: AtomicClaimArgs, seenToken: string): Promise<boolean>
  complete (lease: Lease, response: StoredResponse, ttlMs: number): Promise<boolean>
  /** Holds the record `lease` owns (what recovery.ts `hold` writes); false when it owns none. */
  holdOwned (lease: Lease): Promise<boolean>
  /** Inserts a held record for the key; false when a record is already there. */
  insertHeld (args: AtomicClaimArgs): Promise<boolean>
}

/** An atomic claim has no lease to bind: its record is held until the transaction records the response. */
export type AtomicClaimArgs = Omit<ClaimArgs, 'leaseMs' | 'ttlMs'>

/**
 * What the atomic claim statement saw. `busy`: another transaction holds the key's lock (an
 * uncommitted claim of the key, or a duplicate's for a moment), so nothing was inserted; `record`
 * is the one in the way when it is visible. Null, as for the lease-mode claim: nothing inserted,
 * nothing in the snapshot, the lock got (the record in the way was committed after the snapshot,
 * or the lock's holder ended between the statement's two tries).
 */
export type AtomicClaimResult =
  | { readonly acquired: true }
  | { readonly acquired: false, readonly busy: false, readonly record: ExistingRecord }
  | { readonly acquired: false, readonly busy: true, readonly record: ExistingRecord | null }
  | null

/**
 * The key of (scope, key)'s advisory lock, as the decimal text of an int8: the first 8 bytes of a
 * SHA-256 of both. Two keys that share one (a chance of 2^-64 per pair) only make a claim of one
 * see the other's in flight for as long as its transaction lasts.
 */
export function keyLock (scope: string, key: string): string {
  return createHash('sha256').update(JSON.stringify([scope, key])).digest().readBigInt64BE(0).toString()
}

type Headers = StoredResponse['headers']

/** Columns of the claim and get statements, in SELECT order. */
type RecordColumns = [
  state: 'in_progress' | 'completed', algorithm: string, digest: Buffer, token: string, expired: boolean,
  lapsed: boolean | null, remaining: number, status: number | null, headers: Headers | null, body: Buffer | null,
  expiresIn: number
]
type ClaimColumns = [acquired: boolean, ...RecordColumns]

/** now() plus the duration in ms bound as parameter $n. */
export const later = (n: number): string => `now() + $${n}::float8 * interval '1 millisecond'`
// Milliseconds from now until a timestamp, as epochs: a held record's expires_at is 'infinity'
// (drivers/postgres/recovery.ts), and PostgreSQL refuses to subtract infinite timestamps.
const msUntil = (column: string): string => `(extract(epoch FROM ${column}) - extract(epoch FROM now())) * 1000`
/**
 * The record's columns as RecordColumns lists them (the claim and get statements; the alternatives
 * in benchmarks/postgres-claim-forms.ts). The lease's remaining time is computed by the database (0
 * once lapsed; ceil so that it is 0 exactly when lease_expires_at <= now()). The body of an expired
 * record is not fetched: it is about to be replaced.
 */
export const RECORD_COLUMNS = `
    state, fingerprint_algorithm, fingerprint, owner_token::text, expires_at <= now(),
    lease_expires_at <= now() AND NOT indeterminate,
    greatest(0, ceil(${msUntil('lease_expires_at')}))::float8,
    response_status, response_headers, CASE WHEN expires_at > now() THEN response_body END,
    greatest(0, floor(${msUntil('expires_at')}))::float8`

/**
 * Every statement's text, for `table` (the quoted, schema-qualified name of the records table).
 * Each is built ONCE per table (textsFor), and each call only binds its values: building a
 * statement from nested fragments on every call (and so its ~1 kB text and the prepared-statement
 * lookup key) was most of the driver's CPU time. The values are the only input: no text is ever
 * built from one. Where a parameter's type matters, the text casts it; the others (scope, key, the
 * fingerprint algorithm) take their column's type, text.
 */
function buildTexts (table: string) {
  // claim, reclaim and takeover bind the same values (claimValues), in this order:
  // $1 scope, $2 key, $3 digest, $4 algorithm, $5 new token, $6 lease ms, $7 ttl ms, $8 seen token.

  // The fresh-key path in ONE statement: the insert claims the key, or (ON CONFLICT DO NOTHING)
  // changes nothing and the second branch reads the row that is in the way. On plain PostgreSQL
  // both branches share the statement's snapshot, so the read cannot see the row this statement
  // inserted: NOT EXISTS keeps it from also returning a row deleted concurrently. If the
  // conflicting row was committed after the snapshot was taken (the insert waited for its
  // inserter), the read sees nothing and the result is null: the caller runs the statement again
  // with a new snapshot.
  // On Citus the CTE runs first, as a statement of its own on the worker, then
  // the read: two coordinator-worker round trips and two snapshots, so the shared snapshot above
  // does not hold there. Still correct: NOT EXISTS (SELECT FROM claimed) is decided by the insert's
  // own result, not by what the read sees, so the read never reports this statement's insert as
  // someone else's record, and a read that finds nothing is the same null, retried.
  // DO NOTHING, never DO UPDATE: on Citus its SET/WHERE allow immutable expressions only,
  // and a DO UPDATE that returns the row would make every duplicate write a row version
  // (benchmarks/postgres-claim-forms.ts: fresh claims 0.88-1.01x, duplicates 0.85-0.93x, 205-211 WAL bytes each).
  const claimText = `
    WITH claimed AS (
      INSERT INTO ${table} (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, lease_expires_at, expires_at)
      VALUES ($1, $2, $3::bytea, $4, 'in_progress', $5::uuid, ${later(6)}, greatest(${later(7)}, ${later(6)}))
      ON CONFLICT (scope, key) DO NOTHING
      RETURNING true AS acquired
    )
    SELECT acquired, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM claimed
    UNION ALL
    SELECT false, ${RECORD_COLUMNS}
    FROM ${table}
    WHERE scope = $1 AND key = $2 AND NOT EXISTS (SELECT FROM claimed)
  `

  // A record past its ttl is dead: any request reclaims it as a fresh one (takeover: false). The
  // token seen by the claim statement pins the row version, so two reclaimers cannot both win.
  const reclaimText = `
    UPDATE ${table}
    SET fingerprint = $3::bytea, fingerprint_algorithm = $4,
        state = 'in_progress', owner_token = $5::uuid,
        lease_expires_at = ${later(6)}, expires_at = greatest(${later(7)}, ${later(6)}), created_at = now(),
        response_status = NULL, response_headers = NULL, response_body = NULL,
        steps = '{}', indeterminate = false
    WHERE scope = $1 AND key = $2 AND owner_token = $8::uuid AND expires_at <= now()
  `

  // An in-progress record whose owner stopped renewing, retried with the same request: handed to
  // a new token (the old one stops working: complete/release/renew are fenced by it), with its
  // recorded steps, so the new owner continues from the first incomplete one. The record lives at
  // least a ttl from now, as a newly created one would, and at least as long as the new lease
  // (lib/core/store.ts: an in-progress record never expires while its lease is live). A record held for the reconciler
  // (indeterminate) is never taken over by a retry.
  const takeoverText = `
    UPDATE ${table}
    SET owner_token = $5::uuid, lease_expires_at = ${later(6)},
        expires_at = greatest(expires_at, ${later(7)}, ${later(6)})
    WHERE scope = $1 AND key = $2 AND owner_token = $8::uuid
      AND state = 'in_progress' AND lease_expires_at <= now() AND NOT indeterminate AND expires_at > now()
      AND fingerprint_algorithm = $4 AND fingerprint = $3::bytea
  `

  // Fenced by the token, not by time: an owner whose lease lapsed but was not taken over still
  // records its outcome (the effect happened; recording it is what stops a second execution).
  // The headers are bound as JSON text and cast by the database: a parameter the database
  // describes as jsonb would be JSON-encoded by postgres.js a second time (into a JSON string).
  // Retention counts from completion: in atomic mode this runs at the end of the request's
  // transaction, where now() is the transaction's START, so a handler slower than the ttl would
  // commit a record that is already expired; statement_timestamp() is this statement's start.
  const completeText = `
    UPDATE ${table}
    SET state = 'completed', response_status = $4::int,
        response_headers = $5::text::jsonb, response_body = $6::bytea,
        lease_expires_at = NULL, expires_at = statement_timestamp() + $7::float8 * interval '1 millisecond'
    WHERE scope = $1 AND key = $2 AND owner_token = $3::uuid AND state = 'in_progress'
  `

  const releaseText = `
    DELETE FROM ${table}
    WHERE scope = $1 AND key = $2 AND owner_token = $3::uuid AND state = 'in_progress'
  `

  // The record is kept at least until the lease ends: a handler running longer than the ttl must
  // not have its in-progress record expire (and be reclaimed by a retry) while it still renews.
  const renewText = `
    UPDATE ${table}
    SET lease_expires_at = ${later(4)}, expires_at = greatest(expires_at, ${later(4)})
    WHERE scope = $1 AND key = $2 AND owner_token = $3::uuid AND state = 'in_progress'
  `

  const getText = `
    SELECT ${RECORD_COLUMNS}
    FROM ${table}
    WHERE scope = $1 AND key = $2 AND expires_at > now()
  `

  // The portable bounded form (Citus refuses ctid batches and a multi-shard SKIP LOCKED), with
  // `expires_at <= now()` repeated on the outer DELETE. Without it, a record reclaimed by a
  // concurrent claim after the subquery picked it would still be deleted: EvalPlanQual re-checks
  // the DELETE's own conditions on the new row version, not the subquery's, so the live record
  // of a new owner would vanish (and a retry would execute a second time). The limit fits an int:
  // the store never asks for more than purgeBatch (at most 2^31 - 1) in one statement.
  const purgeText = `
    DELETE FROM ${table}
    WHERE expires_at <= now()
      AND (scope, key) IN (SELECT scope, key FROM ${table} WHERE expires_at <= now() LIMIT $1::int)
  `

  // Atomic mode (AtomicStatements). They bind, in this order: $1 scope, $2 key, $3 digest,
  // $4 algorithm, $5 new token, $6 seen token (reclaim and takeover). A held record is what
  // recovery.ts `hold` writes: in progress, `indeterminate`, its lease ended (lease_expires_at =
  // now(), so the reconciler finds it as soon as it is committed) and never expiring ('infinity':
  // never reclaimed as a fresh record, never purged). Citus: constants and now() only, no CASE, no
  // volatile function, DO NOTHING on conflict, `scope = $1` in every WHERE.
  const held = "state = 'in_progress', lease_expires_at = now(), expires_at = 'infinity', indeterminate = true"
  const insertHeld = `
      INSERT INTO ${table} (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, lease_expires_at, expires_at, indeterminate)
      VALUES ($1, $2, $3::bytea, $4, 'in_progress', $5::uuid, now(), 'infinity', true)
      ON CONFLICT (scope, key) DO NOTHING`

  // The claim never waits for another transaction: a duplicate of a claim not yet committed would
  // otherwise block on its row until that transaction ends, holding a pooled connection all the
  // while. So it inserts only once it has the key's advisory lock (pg_try_advisory_xact_lock, $6:
  // a hash of scope and key, keyLock below), which every atomic claim of the key takes and keeps
  // until its transaction ends (a PREPARE TRANSACTION keeps it too): the insert can then meet only a
  // committed record, or a lease-mode statement's for a moment. The lock is tried in the insert's
  // own WHERE, over a query of the record's row (a count: one row whatever is there), so that on
  // Citus the whole SELECT goes to the worker that holds the row and the lock is taken there,
  // inside the worker's part of the transaction: a transaction that a dead coordinator left
  // prepared there keeps it, and a claim finds the key taken instead of waiting for the prepared
  // row until Citus recovers it. Nothing inserted, `attempt` tries the lock again, after the insert
  // (a CTE that Citus runs after `claimed`, on the same worker), and the third branch says when it
  // was not got (acquired NULL), beside the record in the way if one is visible: the lock's holder
  // is an uncommitted claim of the key, or a duplicate that took it for a moment. The lock is
  // re-entrant, so the second try is true whenever the first one was; got only at the second try
  // (its holder ended in between), the answer is the record in the way, or none (null: the caller
  // claims again, holding the lock). The mark a guarded handle's probe reads (client.ts,
  // TRANSACTION_MARK) is set by the first branch's filter, which Citus evaluates on the
  // coordinator, where the probe reads it: it costs no statement. On Citus every step reaches
  // that one worker only: Citus commits a transaction with an INSERT … SELECT planned through the
  // coordinator in two phases, and this way prepares it on one worker, not on every worker.
  const atomicClaimText = `
    WITH claimed AS (
      INSERT INTO ${table} (scope, key, fingerprint, fingerprint_algorithm, state, owner_token, lease_expires_at, expires_at, indeterminate)
      SELECT $1, $2, $3::bytea, $4, 'in_progress', $5::uuid, now(), 'infinity', true
      FROM (SELECT count(*) FROM ${table} WHERE scope = $1 AND key = $2) AS the_row
      WHERE pg_try_advisory_xact_lock($6::int8)
      ON CONFLICT (scope, key) DO NOTHING
      RETURNING true AS acquired
    ), attempt AS MATERIALIZED (
      SELECT pg_try_advisory_xact_lock($6::int8) AS got
      FROM (SELECT count(*) FROM ${table} WHERE scope = $1 AND key = $2) AS the_row
    )
    SELECT acquired, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM claimed
    WHERE (SELECT set_config('${MARK_SETTING}', 'open', true)) IS NOT NULL
    UNION ALL
    SELECT false, ${RECORD_COLUMNS}
    FROM ${table}
    WHERE scope = $1 AND key = $2 AND NOT EXISTS (SELECT FROM claimed)
    UNION ALL
    SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM attempt
    WHERE NOT got AND NOT EXISTS (SELECT FROM claimed)
  `

  const atomicReclaimText = `
    UPDATE ${table}
    SET fingerprint = $3::bytea, fingerprint_algorithm = $4, owner_token = $5::uuid, ${held}, created_at = now(),
        response_status = NULL, response_headers = NULL, response_body = NULL, steps = '{}'
    WHERE scope = $1 AND key = $2 AND owner_token = $6::uuid AND expires_at <= now()
  `

  // A lapsed lease-mode record keeps its recorded steps, as a lease-mode takeover does.
  const atomicTakeoverText = `
    UPDATE ${table}
    SET owner_token = $5::uuid, ${held}
    WHERE scope = $1 AND key = $2 AND owner_token = $6::uuid
      AND state = 'in_progress' AND lease_expires_at <= now() AND NOT indeterminate AND expires_at > now()
      AND fingerprint_algorithm = $4 AND fingerprint = $3::bytea
  `

  // completeText, and the record is no longer held: it expires after its retention as any other.
  const atomicCompleteText = `
    UPDATE ${table}
    SET state = 'completed', response_status = $4::int,
        response_headers = $5::text::jsonb, response_body = $6::bytea,
        lease_expires_at = NULL, expires_at = statement_timestamp() + $7::float8 * interval '1 millisecond',
        indeterminate = false
    WHERE scope = $1 AND key = $2 AND owner_token = $3::uuid AND state = 'in_progress'
  `

  // recovery.ts `hold`, for a transaction the handler ended (transaction.ts, holdAfterEnd).
  const holdOwnedText = `
    UPDATE ${table} SET ${held}
    WHERE scope = $1 AND key = $2 AND owner_token = $3::uuid AND state = 'in_progress'
  `

  return {
    claimText,
    reclaimText,
    takeoverText,
    completeText,
    releaseText,
    renewText,
    getText,
    purgeText,
    atomicClaimText,
    atomicReclaimText,
    atomicTakeoverText,
    atomicCompleteText,
    holdOwnedText,
    insertHeldText: insertHeld
  }
}

type Texts = ReturnType<typeof buildTexts>
const built = new Map<string, Texts>()

/** The texts for `table`, built once: atomic mode binds them to each request's transaction. */
function textsFor (table: string): Texts {
  let texts = built.get(table)
  if (texts === undefined) {
    texts = buildTexts(table)
    built.set(table, texts)
  }
  return texts
}

/** `db`: the pool (lease mode; also the reconciler's statements). */
export function createStatements (db: Queryable, table: string): Statements {
  const { claimText, reclaimText, takeoverText, completeText, releaseText, renewText, getText, purgeText } = textsFor(table)
  const run = (text: string, values: Value[]): ReturnType<Queryable['query']> => db.query(text, values)
  const claimValues = (args: ClaimArgs, seenToken: string): Value[] =>
    [args.scope, args.key, args.fingerprint.digest, args.fingerprint.algorithm, args.token, args.leaseMs, args.ttlMs, seenToken]

  return {
    async claim (args) {
      const { rows } = await run(claimText, [
        args.scope, args.key, args.fingerprint.digest, args.fingerprint.algorithm, args.token, args.leaseMs, args.ttlMs
      ])
      const row = rows[0] as ClaimColumns | undefined
      if (row === undefined) return null
      if (row[0]) return { acquired: true }
      const [, ...record] = row
      return { acquired: false, record: recordOf(record) }
    },

    async reclaim (args, seenToken) {
      const result = await run(reclaimText, claimValues(args, seenToken))
      return result.count === 1
    },

    async takeover (args, seenToken) {
      const result = await run(takeoverText, claimValues(args, seenToken))
      return result.count === 1
    },

    async complete (lease, response, ttlMs) {
      const result = await run(completeText, [
        lease.scope, lease.key, lease.token, response.statusCode, JSON.stringify(response.headers), response.body, ttlMs
      ])
      return result.count === 1
    },

    async release (lease) {
      const result = await run(releaseText, [lease.scope, lease.key, lease.token])
      return result.count === 1
    },

    async renew (lease, leaseMs) {
      const result = await run(renewText, [lease.scope, lease.key, lease.token, leaseMs])
      return result.count === 1
    },

    async get (id) {
      const { rows } = await run(getText, [id.scope, id.key])
      const row = rows[0] as RecordColumns | undefined
      return row === undefined ? null : recordOf(row)
    },

    async purge (limit) {
      const result = await run(purgeText, [limit])
      return result.count
    }
  }
}

/** `db`: the request's transaction (transaction.ts). */
export function createAtomicStatements (db: Queryable, table: string): AtomicStatements {
  const texts = textsFor(table)
  const values = (args: AtomicClaimArgs): Value[] => [args.scope, args.key, args.fingerprint.digest, args.fingerprint.algorithm, args.token]
  const changed = async (text: string, bound: Value[]): Promise<boolean> => (await db.query(text, bound)).count === 1
  return {
    async claim (args) {
      const { rows } = await db.query(texts.atomicClaimText, [...values(args), keyLock(args.scope, args.key)])
      let busy = false
      let record: ExistingRecord | null = null
      for (const row of rows as unknown as Array<[boolean | null, ...RecordColumns]>) {
        if (row[0] === true) return { acquired: true }
        if (row[0] === null) busy = true
        else record = recordOf(row.slice(1) as unknown as RecordColumns)
      }
      if (busy) return { acquired: false, busy, record }
      return record === null ? null : { acquired: false, busy, record }
    },
    reclaim: (args, seenToken) => changed(texts.atomicReclaimText, [...values(args), seenToken]),
    takeover: (args, seenToken) => changed(texts.atomicTakeoverText, [...values(args), seenToken]),
    complete: (lease, response, ttlMs) => changed(texts.atomicCompleteText, [
      lease.scope, lease.key, lease.token, response.statusCode, JSON.stringify(response.headers), response.body, ttlMs
    ]),
    holdOwned: (lease) => changed(texts.holdOwnedText, [lease.scope, lease.key, lease.token]),
    insertHeld: (args) => changed(texts.insertHeldText, values(args))
  }
}

function recordOf (columns: RecordColumns): ExistingRecord {
  const [state, algorithm, digest, token, expired, lapsed, remaining, status, headers, body, expiresIn] = columns
  return {
    state,
    fingerprint: { algorithm, digest },
    token,
    expired,
    lapsed: lapsed === true,
    leaseRemainingMs: remaining,
    expiresInMs: expiresIn,
    response: state === 'completed' && status !== null ? { statusCode: status, headers: headers ?? {}, body } : null
  }
}
