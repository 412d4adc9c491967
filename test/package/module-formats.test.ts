import t from 'tap'
import { consumerProject, run, tsc, tsconfig } from '../helpers/consumer.js'

/**
 * The package is ESM-only, and what the README says about CommonJS and TypeScript consumers holds
 * on the Node running the tests.
 */

const ESM_CONSUMER = `import Fastify from 'fastify'
import idempotency, { memoryStore, type IdempotencyOptions } from 'fastify-idempotency'
import { postgresStore, type PostgresStore } from 'fastify-idempotency/postgres'
import { redisPrefilter } from 'fastify-idempotency/redis'
import { createIdempotentClient } from 'fastify-idempotency/client'
import { runConformance, type ConformanceOptions } from 'fastify-idempotency/conformance'

const options: IdempotencyOptions = { store: memoryStore(), scope: (request) => String(request.headers['x-account-id']) }
const app = Fastify()
await app.register(idempotency, options)
app.post('/p', { config: { idempotency: { wait: 100 } } }, async (request) => ({ key: request.idempotency?.key ?? null }))
export const used = [postgresStore, redisPrefilter, createIdempotentClient, runConformance] as const
export type Used = PostgresStore | ConformanceOptions
`

t.test('require() from a .cjs file: the plugin is the default member, and it works', async (t) => {
  const dir = consumerProject(t, {
    'app.cjs': `const Fastify = require('fastify')
const { default: idempotency, memoryStore } = require('fastify-idempotency')
const { postgresStore } = require('fastify-idempotency/postgres')
const { createIdempotentClient } = require('fastify-idempotency/client')

async function main () {
  const app = Fastify()
  await app.register(idempotency, { store: memoryStore(), scope: (request) => request.headers['x-account-id'] })
  let runs = 0
  app.post('/payments', async () => ({ run: ++runs }))
  const send = () => app.inject({ method: 'POST', url: '/payments', headers: { 'idempotency-key': '"k"', 'x-account-id': 'a' } })
  const first = await send()
  const again = await send()
  console.log(JSON.stringify({ runs, replayed: again.headers['idempotent-replayed'], same: first.body === again.body,
    exports: [typeof postgresStore, typeof createIdempotentClient] }))
  await app.close()
}
main().catch((err) => { console.error(err); process.exit(1) })
`
  })
  const result = await run(process.execPath, ['app.cjs'], dir)
  t.equal(result.code, 0, result.out)
  const line = result.out.split('\n').find((l) => l.startsWith('{'))
  t.same(JSON.parse(line ?? '{}'), { runs: 1, replayed: 'true', same: true, exports: ['function', 'function'] }, `on Node ${process.version}`)
})

t.test('TypeScript consumers type-check: .cts with require, node16 and bundler resolution', async (t) => {
  const dir = consumerProject(t, {
    'package.json': '{ "type": "module" }',
    'cts/app.cts': `import Fastify = require('fastify')
import idempotency = require('fastify-idempotency')
import postgresEntry = require('fastify-idempotency/postgres')

const app = Fastify()
app.register(idempotency.default, { store: idempotency.memoryStore(), scope: (request) => String(request.headers['x-account-id']) })
export const store: typeof postgresEntry.postgresStore = postgresEntry.postgresStore
`,
    'cts/tsconfig.json': tsconfig({ module: 'nodenext', moduleResolution: 'nodenext' }, ['app.cts']),
    'node16/app.ts': ESM_CONSUMER,
    'node16/tsconfig.json': tsconfig({ module: 'node16', moduleResolution: 'node16' }, ['app.ts']),
    'bundler/app.ts': ESM_CONSUMER,
    'bundler/tsconfig.json': tsconfig({ module: 'esnext', moduleResolution: 'bundler' }, ['app.ts'])
  })
  for (const project of ['cts', 'node16', 'bundler']) {
    const result = await tsc(dir, `${project}/tsconfig.json`)
    t.equal(result.code, 0, `${project}: ${result.out}`)
  }
})

t.test('the conformance export runs under node:test, without tap installed, and fails a broken store', async (t) => {
  const suite = (store: string): string => `import { test } from 'node:test'
import { runConformance } from 'fastify-idempotency/conformance'
import { memoryStore } from 'fastify-idempotency'

runConformance({ test, makeStore: () => ${store} })
`
  const dir = consumerProject(t, {
    'package.json': '{ "type": "module" }',
    'good.test.js': suite('memoryStore({ purgeInterval: 0 })'),
    // Forgets completions: a claim after complete() still says in progress.
    'broken.test.js': suite('((s) => ({ ...s, complete: async () => true }))(memoryStore({ purgeInterval: 0 }))')
  }, ['tap', '@tapjs'])
  const good = await run(process.execPath, ['--test-reporter=tap', 'good.test.js'], dir)
  t.equal(good.code, 0, good.out)
  const passed = Number(/^# pass (\d+)$/m.exec(good.out)?.[1] ?? 0)
  t.ok(passed >= 13, `${passed} cases passed`)
  t.match(good.out, /^# fail 0$/m)
  const broken = await run(process.execPath, ['--test-reporter=tap', 'broken.test.js'], dir)
  t.not(broken.code, 0, 'a store that loses completions fails the suite')
  t.notMatch(broken.out, /^# fail 0$/m)
})

t.test('the postgres entry point loads with neither client installed, and its types need nothing of node-postgres (pg and postgres are optional peers)', async (t) => {
  const loading = consumerProject(t, {
    'package.json': '{ "type": "module" }',
    'load.mjs': `const entry = await import('fastify-idempotency/postgres')
let refused = ''
try { entry.postgresStore({}) } catch (err) { refused = err.message }
console.log(JSON.stringify({ exports: Object.keys(entry).sort(), refused }))
`
  }, ['pg', 'postgres', '@types/pg'])
  const loaded = await run(process.execPath, ['load.mjs'], loading)
  t.equal(loaded.code, 0, loaded.out)
  const line = JSON.parse(loaded.out.split('\n').find((l) => l.startsWith('{')) ?? '{}') as { exports?: string[], refused?: string }
  t.same(line.exports, ['migrate', 'postgresStore'], 'the entry point loads without either client')
  t.match(line.refused, /option "sql" or "pool" must be a postgres \(porsager\) client as \{ sql \}, or a node-postgres Pool as \{ pool \}/, 'and says what it needs')

  // A postgres.js application without pg or @types/pg, with skipLibCheck off: the driver's
  // declarations must not name node-postgres's types (they describe the Pool structurally).
  const typing = consumerProject(t, {
    'package.json': '{ "type": "module" }',
    'app.ts': `import postgres from 'postgres'
import { postgresStore, type AtomicTransaction } from 'fastify-idempotency/postgres'
export const store = postgresStore({ sql: postgres('postgres://localhost/app') })
export async function write (tx: AtomicTransaction): Promise<void> { await tx\`select 1\` }
`,
    'tsconfig.json': tsconfig({ module: 'node16', moduleResolution: 'node16', skipLibCheck: false }, ['app.ts'])
  }, ['pg', '@types/pg'])
  const checked = await tsc(typing)
  t.equal(checked.code, 0, checked.out)
})
