import { fileURLToPath } from 'node:url'
import t from 'tap'
import { postgresStore } from '../../drivers/postgres/index.js'
import { deriveKey } from '../../lib/core/derive.js'
import { spawnFixture, type ChildApp } from '../helpers/child-app.js'
import { CLIENT, endPools, storeConnection } from '../helpers/postgres-clients.js'
import { startFakeProvider, type FakeProvider } from '../helpers/fake-provider.js'
import { postgresSchema } from '../helpers/postgres-schema.js'
import { sleep } from '../helpers/sleep.js'

/**
 * External effects across real crashes: an app process is SIGKILLed between its steps, or after
 * its commit but before its outbox delivered, and another process carries on. The provider honours
 * idempotency keys and logs every call: the checks count its calls and its effects. The app
 * instances run their store on the client under test (test/helpers/postgres-clients.ts); the test
 * reads the rows with its own postgres.js client.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/crash.test.ts` (it starts a throwaway PostgreSQL)')
} else {
  suite(DATABASE_URL)
}

const FIXTURE = fileURLToPath(new URL('../fixtures/recovery-server.ts', import.meta.url))
// Longer than starting the next instance takes, so its first retry meets the crashed owner's lease.
const LEASE = 4000

function suite (url: string): void {
  const table = 'records'
  const { name: schema, sql } = postgresSchema(t, url, {
    prefix: 'idem_crash',
    client: { max: 4 },
    // migrated through the client under test
    setup: async ({ sql, name }) => {
      const store = postgresStore({ ...storeConnection(sql), schema: name, table, purgeInterval: 0 })
      await store.migrate()
      await store.close()
    }
  })
  let provider: FakeProvider

  t.before(async () => {
    provider = await startFakeProvider()
  })
  t.teardown(async () => {
    await provider.close()
    await endPools()
  })

  async function instance (crash: string, worker = false): Promise<ChildApp> {
    const app = await spawnFixture(t, FIXTURE, {
      DATABASE_URL: url,
      IDEM_SCHEMA: schema,
      IDEM_TABLE: table,
      PROVIDER_URL: provider.url,
      IDEM_LEASE: String(LEASE),
      IDEM_CRASH: crash,
      IDEM_WORKER: worker ? '1' : ''
    })
    // A run meant for node-postgres must not pass on postgres.js: the fixture says which client it runs on.
    if (await app.next('client') !== CLIENT) throw new Error(`the fixture does not run its store on ${CLIENT}`)
    return app
  }

  const order = (port: number, key: string): Promise<Response> => fetch(`http://127.0.0.1:${port}/orders`, {
    method: 'POST', headers: { 'idempotency-key': `"${key}"`, 'content-type': 'application/json' }, body: '{"amount":100}'
  })

  /** A client that retries 409 (honouring nothing fancier than a short pause) until it gets an answer. */
  async function retryUntilAnswered (port: number, key: string): Promise<{ status: number, body: string, attempts: number, replayed: boolean }> {
    for (let attempts = 1; attempts < 200; attempts++) {
      const response = await order(port, key)
      const body = await response.text()
      if (response.status !== 409) return { status: response.status, body, attempts, replayed: response.headers.get('idempotent-replayed') === 'true' }
      await sleep(100)
    }
    throw new Error(`${key}: still 409 after 200 attempts`)
  }

  t.test('SIGKILL between step 1 and step 2: the retry does not run step 1 again; one charge, one receipt, one recorded response', async (t) => {
    const key = 'crash-between-steps'
    const doomed = await instance('after-charge')
    const lost = order(doomed.port, key).catch((err: unknown) => err)
    t.equal(await doomed.next('between'), key)
    await doomed.kill()
    t.ok(await lost instanceof Error, 'the client lost its connection')
    t.equal(provider.calls.filter((call) => call.resource === 'charges').length, 1, 'the crashed attempt charged once')

    const survivor = await instance('')
    const answer = await retryUntilAnswered(survivor.port, key)
    t.equal(answer.status, 201)
    t.ok(answer.attempts > 1, 'the retry met the crashed owner\'s lease first (409), then took the key over')
    const charges = provider.calls.filter((call) => call.resource === 'charges')
    t.equal(charges.length, 1, 'step 1 did not run again: the provider saw no second charge call')
    t.equal(charges[0]?.key, deriveKey('acct_a', key, 'charge'), 'the charge carried the derived key')
    t.equal(provider.effectsOf('charges'), 1)
    const body = JSON.parse(answer.body) as { charge: { id: string } }
    t.equal(body.charge.id, (provider.effects.get('charges')?.get(charges[0]?.key ?? '') as { id: string }).id, 'the response carries the recorded charge')

    const deadline = Date.now() + 5000
    while (provider.effectsOf('emails') < 1 && Date.now() < deadline) await sleep(20)
    const receipts = provider.calls.filter((call) => call.resource === 'emails')
    t.same(receipts.map((call) => call.key), [deriveKey('acct_a', key, 'receipt')], 'one receipt, delivered after the commit with its derived key')

    const replay = await order(survivor.port, key)
    t.equal(replay.headers.get('idempotent-replayed'), 'true')
    t.equal(await replay.text(), answer.body, 'the response was recorded once and is replayed')
    const [record] = await sql`SELECT state, steps FROM ${sql(schema)}.${sql(table)} WHERE key = ${key}`
    t.equal(record?.state, 'completed')
    t.same(Object.keys(record?.steps as object).sort(), ['charge', 'receipt'])
  })

  t.test('SIGKILL after the commit, before the outbox delivered: the worker of another instance delivers it, once', async (t) => {
    const key = 'crash-before-delivery'
    const doomed = await instance('before-delivery')
    const first = await order(doomed.port, key)
    t.equal(first.status, 201, 'the client got its answer: the receipt is committed in the outbox')
    const firstBody = await first.text()
    t.equal(await doomed.next('delivering'), key)
    await doomed.kill()
    t.equal(provider.effectsOf('emails') - 1, 0, 'the crashed instance never delivered it (only the previous test\'s receipt exists)')
    const [pending] = await sql`SELECT delivered_at, attempts FROM ${sql(schema)}.${sql(`${table}_outbox`)} WHERE key = ${key}`
    t.same([pending?.delivered_at, pending?.attempts], [null, 1], 'left undelivered, one attempt started')

    const worker = await instance('', true)
    const deadline = Date.now() + 10_000
    const receiptKey = deriveKey('acct_a', key, 'receipt')
    while (provider.effects.get('emails')?.has(receiptKey) !== true && Date.now() < deadline) await sleep(20)
    t.ok(provider.effects.get('emails')?.has(receiptKey), 'delivered by the worker after the visibility timeout')
    await sleep(400)
    t.equal(provider.calls.filter((call) => call.key === receiptKey).length, 1, 'exactly one delivery call')
    const [delivered] = await sql`SELECT delivered_at FROM ${sql(schema)}.${sql(`${table}_outbox`)} WHERE key = ${key}`
    t.ok(delivered?.delivered_at instanceof Date, 'marked delivered')
    const replay = await order(worker.port, key)
    t.equal(await replay.text(), firstBody)
    t.equal(provider.calls.filter((call) => call.resource === 'charges' && call.key === deriveKey('acct_a', key, 'charge')).length, 1)
  })
}
