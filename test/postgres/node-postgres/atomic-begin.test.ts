import Fastify, { type FastifyInstance } from 'fastify'
import t, { type Test } from 'tap'
import idempotency from '../../../lib/index.js'
import type { PostgresStore } from '../../../drivers/postgres/index.js'
import { deferred, drained, keyed, nodePostgresWorld, poolClientOf } from '../../helpers/node-postgres-world.js'
import { sleep } from '../../helpers/sleep.js'

/**
 * node-postgres, atomic mode: the PoolClient in `request.idempotency.sql` is the claim's own
 * transaction, opened with BEGIN. While the handler runs, its writes and the claim are uncommitted
 * (invisible to anyone else, one transaction id, one `now()`); they commit with the recorded
 * response, or roll back with the claim.
 */

const DATABASE_URL = process.env.DATABASE_URL
if (DATABASE_URL === undefined || DATABASE_URL === '') {
  t.fail('DATABASE_URL is not set: run `node scripts/test.mjs test/postgres/node-postgres/atomic-begin.test.ts` (it provisions a throwaway PostgreSQL).')
} else {
  suite(DATABASE_URL)
}

interface Seen { readonly ownClaim: string[], readonly xids: string[], readonly nows: string[] }

function suite (url: string): void {
  const db = nodePostgresWorld(t, url)

  /** POST /held inserts a payment, looks at its transaction, says so, and waits for `go` before answering (or throwing). */
  async function world (t: Test): Promise<{ app: FastifyInstance, store: PostgresStore, runs: () => number, seen: Promise<Seen>, go: () => void }> {
    const store = await db.store('records')
    await db.admin`TRUNCATE ${db.admin(db.schema)}.payments, ${db.admin(db.schema)}.records`
    const app = Fastify()
    t.teardown(() => app.close())
    await app.register(idempotency, { store, scope: () => 'test', transaction: true })
    let runs = 0
    let report!: (seen: Seen) => void
    const seen = new Promise<Seen>((resolve) => { report = resolve })
    const gate = deferred()
    app.post<{ Body: { fail?: boolean } }>('/held', async (request, reply) => {
      runs++
      const client = poolClientOf(request)
      const key = request.idempotency?.key ?? ''
      await client.query(`INSERT INTO ${db.payTable} (key, amount) VALUES ($1, 1)`, [key])
      // The claim's row, uncommitted: visible here only if this is the claim's transaction.
      const own = await client.query(`SELECT state FROM "${db.schema}".records WHERE scope = 'test' AND key = $1`, [key])
      // Outside a transaction block every statement is a transaction of its own: a new id, a new now().
      const first = await client.query<{ xid: string, now: string }>('SELECT txid_current()::text AS xid, now()::text AS now')
      await sleep(20)
      const second = await client.query<{ xid: string, now: string }>('SELECT txid_current()::text AS xid, now()::text AS now')
      report({
        ownClaim: own.rows.map((row: { state: string }) => row.state),
        xids: [first.rows[0]?.xid ?? '', second.rows[0]?.xid ?? ''],
        nows: [first.rows[0]?.now ?? '', second.rows[0]?.now ?? '']
      })
      await gate.promise
      if (request.body.fail === true) throw new Error('the card network exploded')
      return reply.code(201).send({ key, run: runs })
    })
    return { app, store, runs: () => runs, seen, go: gate.resolve }
  }

  const post = (app: FastifyInstance, key: string, body: object) => app.inject({ method: 'POST', url: '/held', headers: keyed(key), payload: body })

  /** What the test sees of the transaction while the handler waits. */
  async function whileHeld (t: Test, key: string, seen: Seen): Promise<void> {
    t.same(seen.ownClaim, ['in_progress'], "the handler's client sees the claim's uncommitted row: the same transaction")
    t.equal(seen.xids[0], seen.xids[1], 'one transaction id across its statements')
    t.equal(seen.nows[0], seen.nows[1], 'one transaction start time (now()) across its statements')
    t.equal(await db.payments(key), 0, 'the payment is uncommitted: invisible to another connection')
    t.same(await db.records('records', key), [], 'so is the claim')
    t.equal(await db.idleInTransaction(), 1, 'the connection waits inside a transaction block')
  }

  t.test('the PoolClient is inside BEGIN: its write commits with the recorded response', async (t) => {
    const w = await world(t)
    const answer = post(w.app, 'begin-commit', {})
    await whileHeld(t, 'begin-commit', await w.seen)
    w.go()
    t.equal((await answer).statusCode, 201)
    t.equal(await db.payments('begin-commit'), 1, 'the payment committed')
    t.same(await db.records('records', 'begin-commit'), ['completed'], 'with its recorded response')
    const retry = await post(w.app, 'begin-commit', {})
    t.equal(retry.headers['idempotent-replayed'], 'true')
    t.equal(retry.body, (await answer).body)
    t.equal(w.runs(), 1)
    t.equal(await db.payments('begin-commit'), 1)
    // A replay answers as soon as its claim has read the record; its transaction's ROLLBACK may
    // still be on the wire (the store counts it until it has finished).
    t.equal(await drained(w.store), 0)
    t.equal(await db.idleInTransaction(), 0)
  })

  t.test('the PoolClient is inside BEGIN: its write rolls back with the claim when the handler throws', async (t) => {
    const w = await world(t)
    const answer = post(w.app, 'begin-rollback', { fail: true })
    await whileHeld(t, 'begin-rollback', await w.seen)
    w.go()
    t.equal((await answer).statusCode, 500)
    t.equal(await db.payments('begin-rollback'), 0, 'the payment rolled back')
    t.same(await db.records('records', 'begin-rollback'), [], 'and the claim with it')
    t.equal(await drained(w.store), 0)
    t.equal(await db.idleInTransaction(), 0)
  })
}
