import { randomBytes } from 'node:crypto'
import { createRequire } from 'node:module'
import fc from 'fast-check'
import Fastify from 'fastify'
import type pg from 'pg'
import QueryStream from 'pg-query-stream'
import postgres, { type TransactionSql } from 'postgres'
import t from 'tap'
import idempotency from '../../lib/index.js'
import { postgresStore } from '../../drivers/postgres/index.js'
import { fcParams } from '../adversarial/support.js'
import { CLIENT, endPools, poolLike, storeConnection } from '../helpers/postgres-clients.js'
import { settledCounts } from '../helpers/pool-accounting.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * Atomic mode against a real PostgreSQL (DATABASE_URL), on the client under test: whatever form a
 * statement that ends the transaction takes (COMMIT, END, ROLLBACK, ABORT, the AND CHAIN forms,
 * PREPARE TRANSACTION; letter case, whitespace, `--` comments ending at \n or \r, nested block
 * comments, another statement before or after it in the same text) and however it is sent through
 * request.idempotency.sql, the handler's effect never outlives a free key, and never happens twice.
 *
 * For each generated request: the handler writes an effect row, sends the statement (its failure
 * is caught), and throws or answers 201; then the same request is retried once its lease has
 * passed. After both:
 * - the answer was a 500: a problem (transaction-ended, or not-committed when the server refused
 *   the text and the transaction could not commit) or the handler's own error;
 * - an effect row exists only if the key is held for the reconciler or completed; at most one;
 * - the handler ran once, or twice only when the first run left nothing behind (no effect, no
 *   record: the server refused the text, and the request rolled back as any failed one does).
 *
 * PREPARE TRANSACTION fails here (max_prepared_transactions is 0 by default), and a failed PREPARE
 * TRANSACTION ends the transaction as a ROLLBACK. FC_SEED and FC_RUNS override the seed and the
 * number of runs (test/adversarial/support.ts).
 */

// pg-cursor has no type declarations.
const Cursor = createRequire(import.meta.url)('pg-cursor') as new (text: string) => pg.Submittable & {
  read (rows: number): Promise<unknown[]>
  close (): Promise<void>
}

const LEASE_MS = 50
const PROBLEM = /^tag:fastify-idempotency,2026:(transaction-ended|not-committed)$/

/** A keyword in any letter case. */
const word = (text: string): fc.Arbitrary<string> =>
  fc.array(fc.boolean(), { minLength: text.length, maxLength: text.length })
    .map((upper) => [...text].map((char, i) => upper[i] === true ? char.toUpperCase() : char.toLowerCase()).join(''))

/** Comment text: no line break, no comment delimiter (a `*` or `/` could close or open one). */
const commentText = fc.string({ unit: fc.constantFrom('a', 'Z', ' ', '-', ';', "'", '"', '$', 'é'), maxLength: 8 })
const lineComment = fc.tuple(commentText, fc.constantFrom('\n', '\r', '\r\n')).map(([text, end]) => `--${text}${end}`)
/** PostgreSQL's block comments nest (SQL standard): `/* a /* b *\/ c *\/` is one comment. */
const blockComment: fc.Arbitrary<string> = fc.letrec<{ block: string }>((tie) => ({
  block: fc.tuple(commentText, fc.option(tie('block'), { depthSize: 'small', nil: '' }), commentText).map(([a, inner, b]) => `/*${a}${inner}${b}*/`)
})).block
const space = fc.constantFrom(' ', '\t', '\n', '\r', '\r\n', '  ')
/** What separates two tokens: at least one whitespace or comment (`min` 0 before and after the statement). */
const gap = (min: number): fc.Arbitrary<string> => fc.array(fc.oneof({ weight: 3, arbitrary: space }, lineComment, blockComment), { minLength: min, maxLength: 3 }).map((parts) => parts.join(''))

/** Every statement that ends a transaction block, in its forms. */
const ENDINGS: ReadonlyArray<readonly string[]> = [
  ['COMMIT'], ['COMMIT', 'WORK'], ['COMMIT', 'TRANSACTION'], ['END'], ['END', 'TRANSACTION'],
  ['ROLLBACK'], ['ROLLBACK', 'WORK'], ['ABORT'], ['ABORT', 'TRANSACTION'],
  ['COMMIT', 'AND', 'CHAIN'], ['ROLLBACK', 'AND', 'CHAIN'], ['END', 'AND', 'NO', 'CHAIN'],
  ['PREPARE', 'TRANSACTION', "'x'"]
]

const ending = fc.constantFrom(...ENDINGS).chain((words) =>
  fc.tuple(...words.map((w) => w.startsWith("'") ? fc.constant(w) : word(w)), fc.array(gap(1), { minLength: words.length, maxLength: words.length }))
    .map(([...parts]) => {
      const gaps = parts.pop() as string[]
      return (parts as string[]).map((w, i) => i === 0 ? w : `${gaps[i] ?? ' '}${w}`).join('')
    }))

/** A text holding the ending statement, maybe with an empty statement or another statement before or after it. */
const statementText = fc.record({
  before: fc.constantFrom('', '', ';', 'SELECT 1;', 'select pg_sleep(0);'),
  lead: gap(0),
  ending,
  trail: gap(0),
  after: fc.constantFrom('', '', ';', '; SELECT 1', ';;')
}).map(({ before, lead, ending, trail, after }) => `${before}${lead}${ending}${trail}${after}`)

type Mode = (tx: unknown, text: string) => Promise<unknown>

const MODES: Readonly<Record<string, Mode>> = CLIENT === 'pg'
  ? {
      text: async (tx, text) => await (tx as pg.PoolClient).query(text),
      config: async (tx, text) => await (tx as pg.PoolClient).query({ text, rowMode: 'array' }),
      callback: async (tx, text) => await new Promise((resolve, reject) => {
        (tx as pg.PoolClient).query(text, (err: Error | undefined, result: unknown) => { if (err !== undefined && err !== null) reject(err); else resolve(result) })
      }),
      cursor: async (tx, text) => {
        const cursor = (tx as pg.PoolClient).query(new Cursor(text))
        await cursor.read(10)
        await cursor.close()
      },
      stream: async (tx, text) => {
        // eslint-disable-next-line no-empty
        for await (const _ of (tx as pg.PoolClient).query(new QueryStream(text))) {}
      }
    }
  : {
      unsafe: async (tx, text) => await (tx as TransactionSql<any>).unsafe(text),
      tagged: async (tx, text) => await (tx as TransactionSql<any>)(Object.assign([text], { raw: [text] }) as unknown as TemplateStringsArray),
      simple: async (tx, text) => await (tx as TransactionSql<any>).unsafe(text).simple(),
      cursor: async (tx, text) => {
        // eslint-disable-next-line no-empty
        for await (const _ of (tx as TransactionSql<any>).unsafe(text).cursor()) {}
      }
    }

interface Plan { readonly text: string, readonly mode: string }

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const appName = `idem-ended-prop-${id}`
  const sql = postgres(url, { max: 6, onnotice: () => {}, connection: { application_name: appName } })
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_ended_prop',
    client: { max: 2 },
    migrate: ['records'],
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.effects (key text NOT NULL)`
  })
  t.teardown(async () => {
    await sql.end({ timeout: 2 })
    await endPools()
  })

  t.test(`a generated transaction-ending statement never leaves an effect on a free key, nor runs the handler twice (${CLIENT})`, async (t) => {
    const store = postgresStore({ ...storeConnection(sql), schema, table: 'records', purgeInterval: 0 })
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'test', transaction: true, lease: LEASE_MS })
    const plans = new Map<string, Plan>()
    const runs = new Map<string, number>()
    app.post<{ Body: { then: 'throw' | 'return' } }>('/pay', async (request, reply) => {
      const key = request.idempotency?.key ?? ''
      runs.set(key, (runs.get(key) ?? 0) + 1)
      const plan = plans.get(key) as Plan
      const tx = request.idempotency?.sql
      await (MODES[plan.mode] as Mode)(tx, `INSERT INTO "${schema}".effects (key) VALUES ('${key}')`)
      await (MODES[plan.mode] as Mode)(tx, plan.text).catch(() => {})
      if (request.body.then === 'throw') throw new Error('the handler failed')
      return reply.code(201).send({ done: key })
    })
    const pay = async (key: string, then: string) => await app.inject({ method: 'POST', url: '/pay', headers: { 'idempotency-key': `"${key}"`, 'content-type': 'application/json' }, payload: { then } })

    const failure = (what: string, details: unknown): Error => new Error(`${what}: ${JSON.stringify(details)}`)
    /** The invariant on what a request left: an effect only on a held or completed key, one at most. */
    async function check (key: string, when: string): Promise<{ effects: number, record: { state: string, indeterminate: boolean } | null }> {
      const effects = Number((await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.effects WHERE key = ${key}`)[0]?.n)
      const [row] = await admin`SELECT state, indeterminate FROM ${admin(schema)}.records WHERE key = ${key}`
      const record = row === undefined ? null : { state: String(row.state), indeterminate: row.indeterminate === true }
      if (effects > 1) throw failure(`${when}: the effect happened ${effects} times`, { key })
      const heldOrDone = record !== null && (record.state === 'completed' || record.indeterminate)
      if (effects === 1 && !heldOrDone) throw failure(`${when}: an effect on a key that is neither held nor completed`, { key, record })
      return { effects, record }
    }

    const property = fc.asyncProperty(statementText, fc.constantFrom(...Object.keys(MODES)), fc.constantFrom('throw', 'return'), async (text, mode, then) => {
      const key = `p-${randomBytes(6).toString('hex')}`
      plans.set(key, { text, mode })
      const first = await pay(key, then)
      const answer = first.json() as { type?: unknown, message?: unknown }
      if (first.statusCode !== 500) throw failure('the answer is not a 500', { text, mode, then, status: first.statusCode, body: first.body })
      const problem = typeof answer.type === 'string' && PROBLEM.test(answer.type)
      if (!problem && answer.message !== 'the handler failed') throw failure('the answer is neither a problem nor the handler\'s own failure', { text, mode, then, body: first.body })
      const after = await check(key, 'after the request')
      await sleep(LEASE_MS + 10)
      const retry = await pay(key, then)
      await check(key, 'after the retry')
      const ran = runs.get(key) ?? 0
      const leftNothing = after.effects === 0 && after.record === null
      if (ran > 2 || (ran === 2 && !leftNothing)) throw failure('the handler ran again after its first run left something behind', { text, mode, then, ran, after, retry: retry.statusCode })
      if (!leftNothing && retry.statusCode !== 409) throw failure('the retry of a held or completed key was not refused', { text, mode, then, retry: retry.statusCode })
    })
    try {
      await fc.assert(property, fcParams(0x1dc0ffee, 60))
      t.pass('the property held for every generated request')
    } catch (err) {
      t.fail(String((err as Error).message))
    }

    for (let i = 0; i < 300 && store.openTransactions > 0; i++) await sleep(10)
    t.equal(store.openTransactions, 0, 'no transaction left open')
    const [idle] = await admin`SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = ${appName} AND state LIKE 'idle in transaction%'`
    t.equal(Number(idle?.n), 0, 'no connection left idle in a transaction')
    if (CLIENT === 'pg') {
      const counts = await settledCounts(poolLike(sql))
      t.equal(counts.idle, counts.total, `every client is back in the pool (${JSON.stringify(counts)})`)
    }
  })
}

// Last: the suite uses the constants above.
const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/atomic-ended-property.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}
