import { spawn } from 'node:child_process'
import { fileURLToPath } from 'node:url'
import t from 'tap'
import { postgresSchema } from '../../helpers/postgres-schema.js'

/**
 * node-postgres: a pooled client handed to an atomic-mode transaction in the same socket read
 * that brings the server's FATAL (`pg_terminate_backend`) kills no process. pg-pool takes its
 * idle listener off the client before it hands it over, and `pool.connect()`'s promise lets the
 * driver attach its own only a microtask later; an error parsed in between was emitted on a
 * client with no 'error' listener, which threw and ended the process (the chaos harness's
 * node-postgres run can die of it). The fixture (test/fixtures/node-postgres-handoff.ts)
 * brings the two together by holding its event loop while both arrive; without the driver's
 * callback check-out it dies on every run.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/node-postgres/handoff.test.ts` (it provisions a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

const FIXTURE = fileURLToPath(new URL('../../fixtures/node-postgres-handoff.ts', import.meta.url))
const RUNS = 3

interface FixtureResult { readonly slow: string, readonly claim: { outcome?: string, error?: string, code?: string }, readonly hit: boolean }

function runFixture (url: string, schema: string): Promise<{ code: number | null, stdout: string, stderr: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, ['--import', 'tsx', FIXTURE], { env: { ...process.env, DATABASE_URL: url, SCHEMA: schema }, stdio: ['ignore', 'pipe', 'pipe'] })
    let stdout = ''
    let stderr = ''
    child.stdout.on('data', (chunk: Buffer) => { stdout += chunk.toString() })
    child.stderr.on('data', (chunk: Buffer) => { stderr += chunk.toString() })
    const timer = setTimeout(() => child.kill('SIGKILL'), 30_000)
    child.once('close', (code) => { clearTimeout(timer); resolve({ code, stdout, stderr }) })
  })
}

function suite (url: string): void {
  // idempotency_records: the store's default table, which the fixture's store uses.
  const { name: schema } = postgresSchema(t, url, { prefix: 'idem_handoff', client: { max: 1 }, migrate: ['idempotency_records'] })

  t.test('a client handed over in the read that brings its FATAL: the claim fails, the process lives', async (t) => {
    for (let run = 1; run <= RUNS; run++) {
      const { code, stdout, stderr } = await runFixture(url, schema)
      t.equal(code, 0, `run ${run}: the process lived`, { stderr: stderr.slice(-3_000) })
      const line = stdout.trim().split('\n').pop() ?? ''
      const result = (line.startsWith('{') ? JSON.parse(line) : null) as FixtureResult | null
      t.ok(result?.hit, `run ${run}: the FATAL came in the same read as the hand-over (else this run proves nothing)`, { result })
      t.equal(result?.slow, 'answered', `run ${run}: the statement before the hand-over got its answer`)
      // The transaction's connection is gone: its claim fails with the server's error, sending nothing more.
      t.match(result?.claim, { code: '57P01' }, `run ${run}: the claim failed with the termination`)
    }
  })
}
