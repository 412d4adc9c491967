import { randomBytes } from 'node:crypto'
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { pathToFileURL } from 'node:url'
import Fastify, { type FastifyInstance } from 'fastify'
import { sql as kyselySql } from 'kysely'
import postgres, { type Sql } from 'postgres'
import t, { type Test } from 'tap'
import ts from 'typescript'
import idempotency from '../../lib/index.js'
import { postgresStore, type OutboxMessage, type PostgresStore, type PostgresStoreOptions } from '../../drivers/postgres/index.js'
import { eventually, keyed } from '../helpers/app.js'
import { codeBlocks, ROOT } from '../helpers/markdown.js'
import { endPools, poolLike } from '../helpers/postgres-clients.js'
import { postgresSchema } from '../helpers/postgres-schema.js'

/**
 * ORMs in atomic mode: each recipe of docs/drivers.md ("ORMs in atomic mode"), run as
 * written against PostgreSQL (DATABASE_URL). The recipes are the docs' own ```ts blocks, transpiled
 * and imported (so a test cannot drift from the page: test/docs/docs.test.ts type-checks the same blocks).
 * Drizzle runs on both clients, Kysely on node-postgres; each recipe on the client it is written for.
 *
 * drizzle-orm lives in test/orm/node_modules (scripts/test.mjs installs it): the transpiled recipes
 * are written under test/orm/, so their imports find it there, and the rest at the root.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/orm-recipes.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

/** What a test needs of a Drizzle database; the recipes' modules are untyped here (drizzle-orm is not a root dependency). */
interface DrizzleDb {
  insert (table: unknown): { values (row: Order): Promise<unknown> }
  transaction<T> (fn: (tx: DrizzleDb) => Promise<T>): Promise<T>
  execute (statement: string): Promise<unknown>
}

/** A Kysely<Database> of the Kysely recipe, by the parts a test uses. */
interface KyselyDb {
  insertInto (table: 'orders'): { values (row: Order): { execute (): Promise<unknown> } }
  transaction (): { execute<T> (fn: (trx: KyselyDb) => Promise<T>): Promise<T> }
}

interface Order { item: string, quantity: number }

/** One recipe, as the tests drive it. */
interface Recipe {
  readonly name: string
  readonly client: 'postgres' | 'pg'
  /** Registers the docs' route, POST /orders. */
  routes (app: FastifyInstance): void
  /** Writes an order through the ORM bound to `tx`, the request's handle, as the recipe binds it. */
  insert (tx: unknown, order: Order): Promise<unknown>
  /** The same, inside the ORM's own transaction() on that instance (what the docs say not to do). */
  insertInOwnTransaction (tx: unknown, order: Order): Promise<unknown>
  /** Runs `statement` (SAVEPOINT and the like) through the ORM bound to `tx`. */
  execute (tx: unknown, statement: string): Promise<unknown>
  /** What the ORM's own transaction() fails with on the request's handle (the error or its cause). */
  readonly ownTransactionError: RegExp
}

/** The docs' ```ts block under a heading of docs/drivers.md. */
function recipeSource (heading: string): string {
  const block = codeBlocks('docs/drivers.md').find((b) => b.lang === 'ts' && b.heading === heading)
  if (block === undefined) throw new Error(`docs/drivers.md has no \`\`\`ts block under "${heading}"`)
  return block.code
}

function suite (url: string): void {
  const id = randomBytes(4).toString('hex')
  const { name: schema, sql: admin } = postgresSchema(t, url, {
    prefix: 'idem_orm',
    client: { max: 2 },
    migrate: ['records'],
    setup: ({ sql, name }) => sql`CREATE TABLE ${sql(name)}.orders (id serial PRIMARY KEY, item text NOT NULL, quantity integer NOT NULL)`
  })
  // The recipes' tables are unqualified (`orders`), as in an app: found through search_path.
  const sql = postgres(url, { max: 6, onnotice: () => {}, connection: { application_name: `idem-orm-${id}`, search_path: schema } })
  const pool = poolLike(sql)
  const ormDir = path.join(ROOT, 'test', 'orm')
  const modules = mkdtempSync(path.join(ormDir, '.recipes-'))

  t.teardown(async () => {
    rmSync(modules, { recursive: true, force: true })
    await endPools()
    await sql.end({ timeout: 2 })
  })

  /** Transpiles the block under `heading` and imports it (types erased, as tsx or tsc would). */
  async function load (heading: string): Promise<Record<string, unknown>> {
    if (!existsSync(path.join(ormDir, 'node_modules', 'drizzle-orm'))) {
      throw new Error('test/orm/node_modules has no drizzle-orm: run `npm ci` in test/orm (scripts/test.mjs does)')
    }
    const js = ts.transpileModule(recipeSource(heading), { compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022 } }).outputText
    const file = path.join(modules, `${heading.replace(/\W+/g, '-').toLowerCase()}.mjs`)
    writeFileSync(file, js)
    return await import(pathToFileURL(file).href) as Record<string, unknown>
  }

  const recipes = async (): Promise<Recipe[]> => {
    const drizzlePostgresJs = await load('Drizzle on postgres.js') as {
      orders: unknown
      orm: (tx: unknown, client: Sql) => DrizzleDb
      orderRoutes: (app: FastifyInstance, client: Sql) => void
    }
    const drizzleNodePostgres = await load('Drizzle on node-postgres') as {
      orders: unknown
      orm: (tx: unknown) => DrizzleDb
      orderRoutes: (app: FastifyInstance) => void
    }
    const kysely = await load('Kysely on node-postgres') as {
      orm: (tx: unknown) => KyselyDb
      orderRoutes: (app: FastifyInstance) => void
    }
    return [{
      name: 'Drizzle on postgres.js',
      client: 'postgres',
      routes: (app) => { drizzlePostgresJs.orderRoutes(app, sql) },
      insert: (tx, order) => drizzlePostgresJs.orm(tx, sql).insert(drizzlePostgresJs.orders).values(order),
      insertInOwnTransaction: (tx, order) => drizzlePostgresJs.orm(tx, sql).transaction((inner) => inner.insert(drizzlePostgresJs.orders).values(order)),
      execute: (tx, statement) => drizzlePostgresJs.orm(tx, sql).execute(statement),
      // A TransactionSql has no begin(): Drizzle's transaction() calls the client's.
      ownTransactionError: /this\.client\.begin is not a function/
    }, {
      name: 'Drizzle on node-postgres',
      client: 'pg',
      routes: (app) => { drizzleNodePostgres.orderRoutes(app) },
      insert: (tx, order) => drizzleNodePostgres.orm(tx).insert(drizzleNodePostgres.orders).values(order),
      insertInOwnTransaction: (tx, order) => drizzleNodePostgres.orm(tx).transaction((inner) => inner.insert(drizzleNodePostgres.orders).values(order)),
      execute: (tx, statement) => drizzleNodePostgres.orm(tx).execute(statement),
      // Drizzle sends BEGIN on the client; the guarded PoolClient refuses it (Drizzle wraps the error).
      ownTransactionError: /already inside the request's transaction/
    }, {
      name: 'Kysely on node-postgres',
      client: 'pg',
      routes: (app) => { kysely.orderRoutes(app) },
      insert: (tx, order) => kysely.orm(tx).insertInto('orders').values(order).execute(),
      insertInOwnTransaction: (tx, order) => kysely.orm(tx).transaction().execute((trx) => trx.insertInto('orders').values(order).execute()),
      // Kysely's raw SQL, run on the Kysely bound to the request's client.
      execute: (tx, statement) => kyselySql.raw(statement).execute(kysely.orm(tx) as never),
      ownTransactionError: /already inside the request's transaction/
    }]
  }

  const rows = async (item: string): Promise<number> =>
    Number((await admin`SELECT count(*)::int AS n FROM ${admin(schema)}.orders WHERE item = ${item}`)[0]?.n)
  const records = async (key: string): Promise<string[]> =>
    (await admin`SELECT state FROM ${admin(schema)}.records WHERE key = ${key}`).map((row) => String(row.state))
  const fresh = (what: string): string => `${what}-${randomBytes(6).toString('hex')}`

  interface World { app: FastifyInstance, store: PostgresStore, runs: () => number, drained: () => Promise<boolean> }

  /** An app on the recipe's client: the plugin, the store, and a count of every handler execution. */
  async function world (t: Test, recipe: Recipe, options: Partial<PostgresStoreOptions> = {}): Promise<World> {
    const store = postgresStore({ ...(recipe.client === 'pg' ? { pool } : { sql }), schema, table: 'records', purgeInterval: 0, ...options })
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'test' })
    let runs = 0
    app.addHook('onRoute', (route) => {
      const handler = route.handler
      route.handler = function (this: FastifyInstance, ...args: Parameters<typeof handler>) {
        runs++
        return handler.apply(this, args)
      }
    })
    return {
      app,
      store,
      runs: () => runs,
      // A request answered from a committed record still rolls its own transaction back just after.
      drained: () => eventually(() => store.openTransactions === 0)
    }
  }

  t.test('the recipes', async (t) => {
    for (const recipe of await recipes()) {
      t.test(`${recipe.name}: the documented route runs once per key, its replay is identical, its row is committed once`, async (t) => {
        const { app, runs, drained } = await world(t, recipe)
        recipe.routes(app)
        const key = fresh('key')
        const item = fresh('item')
        const first = await app.inject({ method: 'POST', url: '/orders', headers: keyed(key), payload: { item, quantity: 2 } })
        t.equal(first.statusCode, 201, first.body)
        t.match(first.json(), { item, quantity: 2 })
        const again = await app.inject({ method: 'POST', url: '/orders', headers: keyed(key), payload: { item, quantity: 2 } })
        t.equal(again.statusCode, 201)
        t.equal(again.headers['idempotent-replayed'], 'true')
        t.equal(again.body, first.body, 'byte for byte')
        t.equal(runs(), 1, 'the handler ran once')
        t.equal(await rows(item), 1, 'one order, committed')
        t.same(await records(key), ['completed'])
        t.ok(await drained(), 'no transaction left open')
      })

      t.test(`${recipe.name}: a handler that throws after the ORM's write leaves no row and no record; the retry runs once`, async (t) => {
        const { app, runs, drained } = await world(t, recipe)
        let failing = true
        app.post<{ Body: Order }>('/fragile', { config: { idempotency: { transaction: true } } }, async (request, reply) => {
          await recipe.insert(request.idempotency!.sql, request.body)
          if (failing) throw new Error('after the write')
          return reply.code(201).send({ ok: true })
        })
        const key = fresh('key')
        const item = fresh('item')
        const failed = await app.inject({ method: 'POST', url: '/fragile', headers: keyed(key), payload: { item, quantity: 1 } })
        t.equal(failed.statusCode, 500)
        t.equal(await rows(item), 0, 'the write rolled back with the claim')
        t.same(await records(key), [], 'no record: the key is free')
        failing = false
        const retry = await app.inject({ method: 'POST', url: '/fragile', headers: keyed(key), payload: { item, quantity: 1 } })
        t.equal(retry.statusCode, 201, retry.body)
        const replay = await app.inject({ method: 'POST', url: '/fragile', headers: keyed(key), payload: { item, quantity: 1 } })
        t.equal(replay.headers['idempotent-replayed'], 'true')
        t.equal(runs(), 2, 'the failed attempt and the retry; the replay ran nothing')
        t.equal(await rows(item), 1, 'the retry\'s order, once')
        t.same(await records(key), ['completed'])
        t.ok(await drained(), 'no transaction left open')
      })

      t.test(`${recipe.name}: the ORM's own transaction() on the request's handle fails, and the request rolls back`, async (t) => {
        const { app, runs, drained } = await world(t, recipe)
        recipe.routes(app)
        let caught: unknown
        app.post<{ Body: Order }>('/nested', { config: { idempotency: { transaction: true } } }, async (request) => {
          try {
            await recipe.insertInOwnTransaction(request.idempotency!.sql, request.body)
          } catch (err) {
            caught = err
            throw err
          }
          // Reached only if the ORM's transaction ran: its COMMIT would have ended the request's.
          throw new Error('after the ORM\'s transaction')
        })
        const key = fresh('key')
        const item = fresh('item')
        const nested = await app.inject({ method: 'POST', url: '/nested', headers: keyed(key), payload: { item, quantity: 3 } })
        t.equal(nested.statusCode, 500)
        const reason = [caught, (caught as { cause?: unknown } | undefined)?.cause].map((e) => String((e as Error | undefined)?.message)).join(' / cause: ')
        t.ok(caught instanceof Error, 'the ORM\'s transaction() threw')
        t.match(reason, recipe.ownTransactionError, reason)
        t.equal(await rows(item), 0, 'nothing committed')
        t.same(await records(key), [], 'no record left in progress')
        // The key is free at once: the documented route runs it (a claim left committed in progress would answer 409).
        const after = await app.inject({ method: 'POST', url: '/orders', headers: keyed(key), payload: { item, quantity: 3 } })
        t.equal(after.statusCode, 201, after.body)
        t.equal(runs(), 2)
        t.equal(await rows(item), 1)
        t.ok(await drained(), 'no transaction left open')
      })

      t.test(`${recipe.name}: SAVEPOINT and ROLLBACK TO SAVEPOINT through the ORM undo part of the request's writes`, async (t) => {
        const { app, runs } = await world(t, recipe)
        app.post<{ Body: { kept: string, undone: string } }>('/partial', { config: { idempotency: { transaction: true } } }, async (request, reply) => {
          const tx = request.idempotency!.sql
          await recipe.insert(tx, { item: request.body.kept, quantity: 1 })
          await recipe.execute(tx, 'SAVEPOINT before_extra')
          await recipe.insert(tx, { item: request.body.undone, quantity: 1 })
          await recipe.execute(tx, 'ROLLBACK TO SAVEPOINT before_extra')
          return reply.code(201).send({ ok: true })
        })
        const key = fresh('key')
        const kept = fresh('kept')
        const undone = fresh('undone')
        const response = await app.inject({ method: 'POST', url: '/partial', headers: keyed(key), payload: { kept, undone } })
        t.equal(response.statusCode, 201, response.body)
        t.equal(runs(), 1)
        t.equal(await rows(kept), 1, 'the write before the savepoint committed')
        t.equal(await rows(undone), 0, 'the write after it was rolled back')
        t.same(await records(key), ['completed'])
      })
    }
  })

  t.test('Drizzle on postgres.js sets its client\'s timestamp parsers to text; the store still reads its own times as Dates', async (t) => {
    const recipe = (await recipes()).find((r) => r.name === 'Drizzle on postgres.js')
    if (recipe === undefined) return t.fail('the recipe loads')
    const delivered: OutboxMessage[] = []
    const failures: unknown[] = []
    const { app, store } = await world(t, recipe, {
      outbox: { deliver: (message) => { delivered.push(message) } },
      onBackgroundError: (err) => { failures.push(err) }
    })
    app.post<{ Body: Order }>('/with-messages', { config: { idempotency: { transaction: true } } }, async (request, reply) => {
      const idempotency = request.idempotency!
      await recipe.insert(idempotency.sql, request.body)
      // Two messages: the delivery orders them by their creation time.
      await idempotency.enqueue({ name: 'first', topic: 'orders', payload: 1 })
      await idempotency.enqueue({ name: 'second', topic: 'orders', payload: 2 })
      return reply.code(201).send({ ok: true })
    })
    const key = fresh('key')
    const response = await app.inject({ method: 'POST', url: '/with-messages', headers: keyed(key), payload: { item: fresh('item'), quantity: 1 } })
    t.equal(response.statusCode, 201, response.body)
    const [now] = await sql`SELECT now() AS at`
    t.type(now?.at, 'string', 'the shared client now reads timestamptz as text (Drizzle\'s parsers)')
    t.ok(await eventually(() => delivered.length === 2), `both messages delivered (${delivered.length}; background errors: ${failures.map(String).join('; ')})`)
    t.same(delivered.map((m) => m.name), ['first', 'second'], 'in the order they were enqueued')
    t.ok(delivered.length === 2 && delivered.every((m) => m.createdAt instanceof Date && !Number.isNaN(m.createdAt.getTime())), 'each message\'s createdAt is a Date')
    t.same(failures, [], 'no background error')
    const record = await store.inspect({ scope: 'test', key })
    t.ok(record?.createdAt instanceof Date && !Number.isNaN(record.createdAt.getTime()), `inspect() gives the record's createdAt as a Date (${String(record?.createdAt)})`)
  })
}
