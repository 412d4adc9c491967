import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import Fastify, { type FastifyInstance, type FastifyRequest } from 'fastify'
import postgres, { type TransactionSql } from 'postgres'
import t, { type Test } from 'tap'
import idempotency from '../../lib/index.js'
import { postgresStore, type PostgresStore } from '../../drivers/postgres/index.js'
import { postgresSchema } from '../helpers/postgres-schema.js'

/**
 * Atomic mode on postgres.js: what `request.idempotency.sql` does with the parts of postgres.js's
 * API beyond plain queries. Savepoints in every form postgres.js has (a callback, a named one, a
 * callback returning several queries, a tagged template) run inside the request's transaction
 * and commit with the recorded response. What cannot be kept inside it is refused, with why, and
 * the refusal sends nothing: notify() (another connection), COPY streams (the simple protocol).
 * A statement that fails before it reaches the server (a file that cannot be read) fails alone.
 */

const keyed = (key: string): Record<string, string> => ({ 'idempotency-key': `"${key}"`, 'content-type': 'application/json' })

function transactionOf (request: FastifyRequest): TransactionSql<any> {
  const tx = request.idempotency?.sql
  if (tx === undefined) throw new Error('not in atomic mode')
  return tx
}

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/postgres-js-handle-api.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

function suite (url: string): void {
  const sql = postgres(url, { max: 4, onnotice: () => {} })
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_handle_api',
    client: { max: 2 },
    migrate: ['records'],
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.payments (key text NOT NULL, note text NOT NULL)`
  })
  const stores: PostgresStore[] = []
  t.teardown(async () => {
    for (const store of stores) await store.close()
    await sql.end({ timeout: 2 })
  })

  async function world (t: Test, route: (request: FastifyRequest) => Promise<unknown>): Promise<FastifyInstance> {
    const store = postgresStore({ sql, schema, table: 'records', purgeInterval: 0 })
    stores.push(store)
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'acct', transaction: true })
    app.post('/pay', async (request, reply) => reply.code(201).send(await route(request)))
    return app
  }
  const notes = async (key: string): Promise<string[]> =>
    (await admin`SELECT note FROM ${admin(schema)}.payments WHERE key = ${key} ORDER BY note`).map((row) => String(row.note))

  t.test('savepoints in every form run in the request\'s transaction and commit with its response', async (t) => {
    const key = 'savepoints'
    const app = await world(t, async (request) => {
      const tx = transactionOf(request)
      const insert = (handle: TransactionSql<any>, note: string) => handle`INSERT INTO ${handle(schema)}.payments (key, note) VALUES (${key}, ${note}) RETURNING note`
      const named = await tx.savepoint('named', async (sp) => await insert(sp, 'named'))
      // A callback returning several queries: postgres.js awaits them all.
      const several = await tx.savepoint((sp) => [insert(sp, 'first of two'), insert(sp, 'second of two')] as never)
      // A tagged template: the savepoint holds that one query.
      // (postgres.js's typings have no template form of savepoint.)
      const savepointTemplate = tx.savepoint as unknown as (strings: TemplateStringsArray, ...values: unknown[]) => Promise<Array<{ note: string }>>
      const template = await savepointTemplate`INSERT INTO ${tx(schema)}.payments (key, note) VALUES (${key}, 'template') RETURNING note`
      return { named: named.map((r) => r.note), several: (several as Array<Array<{ note: string }>>).map((rows) => rows.map((r) => r.note)), template: template.map((r) => r.note) }
    })
    const response = await app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: {} })
    t.equal(response.statusCode, 201)
    t.same(response.json(), { named: ['named'], several: [['first of two'], ['second of two']], template: ['template'] })
    t.same(await notes(key), ['first of two', 'named', 'second of two', 'template'], 'committed with the response')
    const replay = await app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: {} })
    t.equal(replay.headers['idempotent-replayed'], 'true')
  })

  t.test('notify() and COPY streams are refused with why; the transaction goes on and commits', async (t) => {
    const key = 'refused'
    const app = await world(t, async (request) => {
      const tx = transactionOf(request)
      const refused: string[] = []
      try { await tx.notify('orders', 'paid') } catch (err) { refused.push((err as Error).message) }
      try {
        await tx`COPY ${tx(schema)}.payments (key, note) FROM STDIN`.writable()
      } catch (err) { refused.push((err as Error).message) }
      await tx`INSERT INTO ${tx(schema)}.payments (key, note) VALUES (${key}, 'after the refusals')`
      return { refused, options: (tx as unknown as { options?: unknown }).options === undefined }
    })
    const response = await app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: {} })
    t.equal(response.statusCode, 201)
    const { refused, options } = response.json() as { refused: string[], options: boolean }
    t.match(refused, [
      /notify\(\) on request\.idempotency\.sql runs on another connection, outside the transaction/,
      /COPY streams \(readable\(\), writable\(\)\) are not sent through request\.idempotency\.sql/
    ])
    t.equal(options, true, 'a property that is not a method reads as the handle\'s own (postgres.js has no `options` on a transaction)')
    t.same(await notes(key), ['after the refusals'])
  })

  t.test('a file() that cannot be read fails alone, before anything is sent; the transaction goes on', async (t) => {
    const key = 'missing-file'
    const dir = mkdtempSync(path.join(tmpdir(), 'idem-file-'))
    t.teardown(() => rmSync(dir, { recursive: true, force: true }))
    const app = await world(t, async (request) => {
      const tx = transactionOf(request)
      let failure = ''
      try { await tx.file(path.join(dir, 'missing.sql')) } catch (err) { failure = (err as NodeJS.ErrnoException).code ?? String(err) }
      await tx`INSERT INTO ${tx(schema)}.payments (key, note) VALUES (${key}, 'after the missing file')`
      return { failure }
    })
    const response = await app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: {} })
    t.equal(response.statusCode, 201)
    t.same(response.json(), { failure: 'ENOENT' })
    t.same(await notes(key), ['after the missing file'])
  })

  t.test('a query cancelled while in line behind another is never sent; describe() answers without a command tag', async (t) => {
    const key = 'cancelled'
    const app = await world(t, async (request) => {
      const tx = transactionOf(request)
      const slow = tx`SELECT pg_sleep(0.1)`.execute()
      const queued = tx`INSERT INTO ${tx(schema)}.payments (key, note) VALUES (${key}, 'cancelled')`.execute()
      queued.cancel()
      const outcome = await queued.then(() => 'sent', (err: Error) => err.message)
      await slow
      const description = await tx`SELECT ${key}::text AS key`.describe()
      await tx`INSERT INTO ${tx(schema)}.payments (key, note) VALUES (${key}, 'after')`
      return { outcome, columns: description.columns.map((c) => c.name) }
    })
    const response = await app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: {} })
    t.equal(response.statusCode, 201)
    t.not(response.json().outcome, 'sent', 'the cancelled query was rejected')
    t.same(response.json().columns, ['key'])
    t.same(await notes(key), ['after'], 'only the query after it was written')
  })

  t.test('savepoint() and file() waiting behind a COMMIT sent through the handle are refused: nothing of theirs is written', async (t) => {
    const key = 'behind-commit'
    const dir = mkdtempSync(path.join(tmpdir(), 'idem-file-'))
    t.teardown(() => rmSync(dir, { recursive: true, force: true }))
    const file = path.join(dir, 'insert.sql')
    writeFileSync(file, `INSERT INTO ${schema}.payments (key, note) VALUES ('${key}', 'file')`)
    let refused: string[] = []
    const app = await world(t, async (request) => {
      const tx = transactionOf(request)
      const slow = tx`SELECT pg_sleep(0.1)`.execute()
      const commit = tx`COMMIT`.execute()
      await new Promise((resolve) => setImmediate(resolve)) // both are in line now, neither answered
      // Both are accepted now (the transaction is still the request's) and wait for the COMMIT.
      const savepoint = tx.savepoint(async (sp) => await sp`INSERT INTO ${sp(schema)}.payments (key, note) VALUES (${key}, 'savepoint')`)
      const fromFile = tx.file(file)
      await slow
      await commit
      refused = await Promise.all([savepoint, fromFile].map(async (query) => await query.then(() => 'sent', (err: Error) => err.message)))
      return {}
    })
    const response = await app.inject({ method: 'POST', url: '/pay', headers: keyed(key), payload: {} })
    t.equal(response.statusCode, 500, 'the handler ended the transaction itself')
    t.match(response.json(), { type: /transaction-ended$/ })
    t.match(refused, [/transaction/, /transaction/])
    t.notOk(refused.includes('sent'))
    t.same(await notes(key), [], 'neither the savepoint\'s insert nor the file\'s was written')
  })
}
