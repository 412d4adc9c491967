import { readFile } from 'node:fs/promises'
import type postgres from 'postgres'
import type { Effect, StoredRecordRow } from './history.js'
import type { ProviderLogLine } from './provider.js'

/**
 * Reads, after the run, what actually happened: the ledger rows (atomic mode's effects), the
 * provider's executed charges (lease mode's effects) and the idempotency records.
 */

export const LEDGER_DDL = `
  CREATE TABLE IF NOT EXISTS ledger (
    id         uuid PRIMARY KEY,
    scope      text NOT NULL,
    key        text NOT NULL,
    amount     integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
  )`

export async function ledgerEffects (sql: postgres.Sql): Promise<Effect[]> {
  const rows = await sql<Array<{ id: string, scope: string, key: string, amount: number }>>`SELECT id, scope, key, amount FROM ledger ORDER BY created_at`
  return rows.map((row) => ({ mode: 'atomic', scope: row.scope, key: row.key, amount: row.amount, ref: row.id }))
}

export interface ProviderLog {
  readonly effects: Effect[]
  /** Calls the provider answered from its own record (a retried or re-run charge). */
  readonly replayed: number
  readonly calls: number
}

export async function providerLog (file: string): Promise<ProviderLog> {
  const text = await readFile(file, 'utf8').catch((err: NodeJS.ErrnoException) => { if (err.code === 'ENOENT') return ''; throw err })
  const effects: Effect[] = []
  let replayed = 0
  let calls = 0
  for (const line of text.split('\n')) {
    if (line === '') continue
    const entry = JSON.parse(line) as ProviderLogLine
    calls++
    if (entry.outcome === 'executed') effects.push({ mode: 'lease', scope: entry.scope, key: entry.key, amount: entry.amount, ref: entry.id })
    else if (entry.outcome === 'replayed') replayed++
  }
  return { effects, replayed, calls }
}

export async function storedRecords (sql: postgres.Sql): Promise<StoredRecordRow[]> {
  const rows = await sql<Array<{ scope: string, key: string, state: string, response_status: number | null }>>`
    SELECT scope, key, state, response_status FROM idempotency_records`
  return rows.map((row) => ({ scope: row.scope, key: row.key, state: row.state, responseStatus: row.response_status }))
}
