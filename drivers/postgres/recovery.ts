import { randomUUID } from 'node:crypto'
import type { InspectedRecord } from '../../lib/core/admin.js'
import { TransactionEndedError } from '../../lib/core/errors.js'
import type { ReconcileSource } from '../../lib/core/reconcile.js'
import type { Lease, RecordId, StepResults, StoredResponse } from '../../lib/core/store.js'
import type { DatabaseClient, Ended, Value } from './client.js'
import { asDate } from './dates.js'

/*
 * Recovery points, indeterminate failures, the reconciler's statements and the operator tools.
 * The same rules as statements.ts: one short statement each, database clock, `scope = $1` in every
 * single-record WHERE (one shard on Citus), fixed prepared texts, writes fenced by the owner token.
 */

export interface Recovery {
  loadSteps (lease: Lease): Promise<StepResults | null>
  saveStep (lease: Lease, name: string, resultJson: string): Promise<boolean>
  runStepInTransaction (lease: Lease, name: string, fn: (transaction: unknown) => Promise<unknown>, toJson: (value: unknown) => string): Promise<string | null>
  hold (lease: Lease): Promise<boolean>
  inspect (id: RecordId): Promise<InspectedRecord | null>
  listHeld (limit: number): Promise<InspectedRecord[]>
  forceRelease (id: RecordId): Promise<boolean>
  /** The reconciler's view of the table; complete/release are the lease-mode statements. */
  source (complete: ReconcileSource['complete'], release: ReconcileSource['release']): ReconcileSource
}

/** Thrown inside a step's transaction to roll it back when the lease was lost; never escapes. */
const LOST = Symbol('lease lost')

type InspectColumns = [
  state: 'in_progress' | 'completed', algorithm: string, digest: Buffer, indeterminate: boolean, steps: Record<string, unknown>,
  createdAt: unknown, leaseRemaining: number, expiresIn: number, status: number | null,
  headers: StoredResponse['headers'] | null, body: Buffer | null
]

/** `table`: the quoted, schema-qualified name of the records table. */
export function createRecovery (db: DatabaseClient, table: string): Recovery {
  const ms = (n: number): string => `$${n}::float8 * interval '1 millisecond'`
  const owned = "scope = $1 AND key = $2 AND owner_token = $3::uuid AND state = 'in_progress'"

  const loadStepsText = `SELECT steps FROM ${table} WHERE ${owned}`

  // `steps || $5` adds one name; the NOT clause keeps a recorded step from ever being overwritten.
  // The step is bound as a one-entry JSON object built by the app (Citus refuses a volatile
  // function in an UPDATE or DELETE).
  const saveStepText = `
    UPDATE ${table} SET steps = steps || $5::text::jsonb
    WHERE ${owned} AND NOT (steps ? $4)`

  // The owner's lease ends now and no retry may take the record over: it waits for the reconciler.
  // It never expires meanwhile ('infinity'): reclaimed as a fresh record at its ttl, it would lose
  // its recorded steps and a retry would repeat effects that happened. Until the reconciler resolves
  // it (complete, release, resume) or an operator force-releases it, it stays.
  const holdText = `UPDATE ${table} SET indeterminate = true, lease_expires_at = now(), expires_at = 'infinity' WHERE ${owned}`

  // Candidates for the reconciler (the partial index on lease_expires_at of in-progress records).
  const findStuckText = `
    SELECT scope, key, owner_token::text FROM ${table}
    WHERE state = 'in_progress' AND lease_expires_at <= now() - ${ms(1)} AND expires_at > now()
    ORDER BY lease_expires_at
    LIMIT $2::int`

  // The reconciler takes a candidate over like a retry would: pinned to the token it saw and
  // re-checking that it is still stuck, so it never acts on a record a retry took meanwhile.
  const acquireText = `
    UPDATE ${table}
    SET owner_token = $4::uuid, lease_expires_at = now() + ${ms(6)}, expires_at = greatest(expires_at, now() + ${ms(6)})
    WHERE ${owned} AND lease_expires_at <= now() - ${ms(5)} AND expires_at > now()
    RETURNING fingerprint_algorithm, fingerprint, steps, indeterminate, created_at`

  const leaveText = `UPDATE ${table} SET indeterminate = $4::boolean, lease_expires_at = now() WHERE ${owned}`

  // A resumed record waits for a retry to take it over; no longer held, it expires again, $4 ms from
  // now at the earliest. A held record's 'infinity' becomes NULL, which greatest() skips, so it gets
  // exactly now() + $4. Not a CASE: Citus refuses a non-immutable function (now()) inside CASE or
  // COALESCE of a statement that writes a distributed table (SQLSTATE 0A000), and the record could
  // then never be resumed.
  const resumeText = `
    UPDATE ${table}
    SET indeterminate = false, lease_expires_at = now(),
        expires_at = greatest(nullif(expires_at, 'infinity'), now() + ${ms(4)})
    WHERE ${owned}`

  // CASE with now() is accepted here: Citus refuses it only in a statement that writes.
  const inspectColumns = `state, fingerprint_algorithm, fingerprint, indeterminate, steps, created_at,
      CASE WHEN state = 'in_progress' THEN greatest(0, ceil((extract(epoch FROM lease_expires_at) - extract(epoch FROM now())) * 1000)) ELSE 0 END::float8,
      greatest(0, floor((extract(epoch FROM expires_at) - extract(epoch FROM now())) * 1000))::float8,
      response_status, response_headers, response_body`
  const inspectText = `SELECT ${inspectColumns} FROM ${table} WHERE scope = $1 AND key = $2 AND expires_at > now()`

  // Held records use the partial index of in-progress records; the set is small by design (it only
  // grows when indeterminate failures are not reconciled).
  const listHeldText = `
    SELECT scope, key, ${inspectColumns} FROM ${table}
    WHERE state = 'in_progress' AND indeterminate
    ORDER BY created_at LIMIT $1::int`

  const forceReleaseText = `DELETE FROM ${table} WHERE scope = $1 AND key = $2 AND state = 'in_progress'`

  const run = (text: string, values: Value[]): ReturnType<DatabaseClient['query']> => db.query(text, values)
  const fenced = (lease: Lease): Value[] => [lease.scope, lease.key, lease.token]
  // A step's JSON text is recorded as a jsonb STRING, not parsed into jsonb: jsonb refuses some
  // JSON that JSON.stringify writes (\u0000, an unpaired surrogate escape), and a step that ran must
  // always be recordable. decodeSteps turns the strings back into the values.
  const stepEntry = (name: string, resultJson: string): string => `{${JSON.stringify(name)}:${JSON.stringify(resultJson)}}`

  return {
    async loadSteps (lease) {
      const rows = (await run(loadStepsText, fenced(lease))).rows
      const row = rows[0] as [Record<string, unknown>] | undefined
      return row === undefined ? null : decodeSteps(row[0])
    },

    async saveStep (lease, name, resultJson) {
      const result = await run(saveStepText, [...fenced(lease), name, stepEntry(name, resultJson)])
      return result.count === 1
    },

    async runStepInTransaction (lease, name, fn, toJson) {
      try {
        // Nothing sent once the connection dropped, not even the ROLLBACK (dropped-connection.ts).
        return await db.transaction(async (tx) => {
          const guarded = tx.guarded()
          let value: unknown
          let ended: Ended | null = null
          try {
            value = await fn(guarded.handle)
          } finally {
            // The handle is fn's, and ends when fn settles, not when the transaction does: a query
            // the step's code sends after that (a write it did not await) would otherwise be queued
            // behind the step's record, COMMIT or ROLLBACK and run on its own once they are done:
            // committed outside the step, even after a rollback, or on postgres.js never answered.
            ended = await guarded.end()
          }
          // fn ended the step's transaction itself: what it wrote may have committed without the
          // step's record, so the step is not recorded and counts as having taken effect.
          if (ended !== null) throw new TransactionEndedError(false, { cause: ended.reason, step: name })
          const json = toJson(value)
          if (tx.connection.lost !== null) throw tx.connection.lost
          // In the step's transaction: the record is written (and the row locked) only if this
          // lease still owns it, and commits with everything `fn` wrote, or neither does.
          const saved = await tx.query(saveStepText, [...fenced(lease), name, stepEntry(name, json)])
          if (saved.count !== 1) throw LOST
          return json
        })
      } catch (err) {
        if (err === LOST) return null
        throw err
      }
    },

    async hold (lease) {
      const result = await run(holdText, fenced(lease))
      return result.count === 1
    },

    async inspect (id) {
      const rows = (await run(inspectText, [id.scope, id.key])).rows
      const row = rows[0] as InspectColumns | undefined
      return row === undefined ? null : inspected(id, row)
    },

    async listHeld (limit) {
      const rows = (await run(listHeldText, [limit])).rows as unknown as Array<[string, string, ...InspectColumns]>
      return rows.map(([scope, key, ...columns]) => inspected({ scope, key }, columns))
    },

    async forceRelease (id) {
      const result = await run(forceReleaseText, [id.scope, id.key])
      return result.count === 1
    },

    source (complete, release) {
      return {
        async findStuck (olderThanMs, limit) {
          const rows = (await run(findStuckText, [olderThanMs, limit])).rows
          return (rows as unknown as Array<[string, string, string]>).map(([scope, key, token]) => ({ scope, key, token }))
        },
        async acquire (candidate, olderThanMs, leaseMs) {
          const token = randomUUID()
          const rows = (await run(acquireText, [candidate.scope, candidate.key, candidate.token, token, olderThanMs, leaseMs])).rows
          const row = rows[0] as [string, Buffer, Record<string, unknown>, boolean, unknown] | undefined
          if (row === undefined) return null
          const [algorithm, digest, steps, indeterminate, createdAt] = row
          return { lease: { scope: candidate.scope, key: candidate.key, token }, fingerprint: { algorithm, digest }, steps: decodeSteps(steps), indeterminate, createdAt: asDate(createdAt) }
        },
        complete,
        release,
        async resume (lease, ttlMs) {
          const result = await run(resumeText, [...fenced(lease), ttlMs])
          return result.count === 1
        },
        async leave (lease, wasIndeterminate) {
          const result = await run(leaveText, [...fenced(lease), wasIndeterminate])
          return result.count === 1
        }
      }
    }
  }
}

function inspected (id: RecordId, row: InspectColumns): InspectedRecord {
  const [state, algorithm, digest, indeterminate, steps, createdAt, leaseRemaining, expiresIn, status, headers, body] = row
  return {
    scope: id.scope,
    key: id.key,
    state,
    fingerprint: { algorithm, digest },
    indeterminate,
    steps: decodeSteps(steps),
    createdAt: asDate(createdAt),
    leaseRemainingMs: leaseRemaining,
    expiresInMs: expiresIn,
    response: state === 'completed' && status !== null ? { statusCode: status, headers: headers ?? {}, body } : null
  }
}

/** The recorded steps, by name: each is stored as its JSON text (see stepEntry). */
function decodeSteps (stored: Record<string, unknown>): StepResults {
  const steps: Record<string, unknown> = {}
  for (const name of Object.keys(stored)) {
    const json = stored[name]
    steps[name] = typeof json === 'string' ? JSON.parse(json) : json
  }
  return steps
}
