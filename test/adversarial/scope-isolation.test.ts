import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import fc from 'fast-check'
import Fastify, { type FastifyInstance, type LightMyRequestResponse } from 'fastify'
import t, { type Test } from 'tap'
import idempotency, { memoryStore } from '../../lib/index.js'
import type { IdempotencyStore } from '../../lib/core/store.js'
import { postgresFixture } from './services.js'
import { assertProblem, errorLog, fcParams } from './support.js'

/*
 * Draft §5: keys belong to a principal. Two principals (the scope comes from a header, through the
 * app's scope function) send random sequences of requests over a few shared key names, some held in
 * flight. A model that knows nothing of the other principal predicts every answer; any replay of
 * the other's response, any 409 or 422 caused by the other's record, breaks it. Scope names are
 * chosen to collide under naive concatenation or normalisation ("1:a" / "1", "é" / "e\u0301").
 */

const KEYS = ['k', 'k:1', 'K'] as const
const BODIES = [{ amount: 100 }, { amount: 200 }] as const

const request = fc.record({
  kind: fc.constantFrom('send' as const, 'send' as const, 'hold' as const),
  who: fc.constantFrom(0 as const, 1 as const),
  key: fc.constantFrom(0 as const, 1 as const, 2 as const),
  body: fc.constantFrom(0 as const, 1 as const)
})
const ops = fc.array(fc.oneof({ weight: 4, arbitrary: request }, { weight: 1, arbitrary: fc.constant({ kind: 'finish' as const }) }), { minLength: 1, maxLength: 20 })

/** Scope pairs that a sloppy store key would confuse, plus generated ones. Well-formed and NUL-free (see storage-bytes.test.ts). */
const TRICKY_PAIRS: ReadonlyArray<readonly [string, string]> = [
  ['A', 'B'], ['1:a', '1'], ['a', 'a:'], ['', ' '], ['acct', 'acct '], ['é', 'e\u0301'], ['😀', '😁'],
  ["t'; DROP TABLE x; --", 't'], ['{tag}', 'tag'], ['a\\', 'a\\\\']
]
const scopeText = fc.oneof(fc.string({ unit: 'grapheme', maxLength: 6 }), fc.string({ maxLength: 6 }))
const scopes = fc.oneof(fc.constantFrom(...TRICKY_PAIRS), fc.tuple(scopeText, scopeText).filter(([a, b]) => a !== b))

interface Held {
  readonly who: 0 | 1
  readonly key: number
  readonly response: Promise<LightMyRequestResponse>
  readonly release: () => void
}

/** What one principal's record for one key looks like to the model. */
interface Modelled { state: 'held' | 'done', body: number, response: string | null }

async function isolationProperty (t: Test, store: IdempotencyStore, numRuns: number, seed: number): Promise<void> {
  const log = errorLog()
  const app: FastifyInstance = Fastify({ logger: log.logger })
  t.teardown(() => app.close())
  let pair: readonly [string, string] = ['A', 'B']
  // '' is one of the generated scopes, kept apart from the others, so the app asks for it (refused by default).
  await app.register(idempotency, { store, scope: (req) => pair[Number(req.headers['x-principal'])] as string, allowEmptyScope: true })

  const gates = new Map<string, { started: () => void, wait: Promise<void> }>()
  const executions = new Map<string, number>()
  app.post('/pay', async (req, reply) => {
    const principal = Number(req.headers['x-principal'])
    const id = `${principal}|${req.idempotency?.key ?? ''}`
    executions.set(id, (executions.get(id) ?? 0) + 1)
    const gate = gates.get(String(req.headers['x-hold']))
    if (gate !== undefined) {
      gate.started()
      await gate.wait
    }
    return reply.code(201).send({ principal, key: req.idempotency?.key, body: req.body, charge: randomUUID() })
  })

  let run = 0
  const answers = { executed: 0, replayed: 0, conflict: 0, mismatch: 0 }
  await fc.assert(fc.asyncProperty(scopes, ops, async (scopePair, sequence) => {
    pair = scopePair
    const prefix = `run${run++}-`
    const model = new Map<string, Modelled>()
    const held: Held[] = []
    executions.clear()
    const send = (who: 0 | 1, key: number, body: number, hold: string | null): Promise<LightMyRequestResponse> =>
      app.inject({
        method: 'POST',
        url: '/pay',
        headers: { 'idempotency-key': `"${prefix}${KEYS[key] ?? ''}"`, 'content-type': 'application/json', 'x-principal': String(who), ...(hold === null ? {} : { 'x-hold': hold }) },
        payload: BODIES[body]
      })

    /** Checks an answer against the model, and updates the model. */
    const check = (res: LightMyRequestResponse, who: 0 | 1, key: number, body: number, label: string): void => {
      const id = `${who}|${key}`
      const known = model.get(id)
      if (known === undefined) {
        assert.equal(res.statusCode, 201, `${label}: a fresh key of this principal executes (${res.body})`)
        assert.equal(res.headers['idempotent-replayed'], undefined, `${label}: not a replay`)
        model.set(id, { state: 'done', body, response: res.body })
        answers.executed++
      } else if (known.body !== body) {
        assertProblem(res, 'key-reused', 422, label)
        answers.mismatch++
      } else if (known.state === 'held') {
        assertProblem(res, 'request-in-progress', 409, label)
        answers.conflict++
      } else {
        assert.equal(res.headers['idempotent-replayed'], 'true', `${label}: a replay`)
        assert.equal(res.body, known.response, `${label}: its own recorded response`)
        answers.replayed++
      }
      if (res.statusCode === 201) {
        assert.equal((JSON.parse(res.body) as { principal: number }).principal, who, `${label}: never the other principal's response`)
      }
    }

    const finish = async (): Promise<void> => {
      const oldest = held.shift()
      if (oldest === undefined) return
      oldest.release()
      const res = await oldest.response
      const entry = model.get(`${oldest.who}|${oldest.key}`) as Modelled
      // The held request is the key's first execution: check() sees it as such.
      model.delete(`${oldest.who}|${oldest.key}`)
      check(res, oldest.who, oldest.key, entry.body, `finish ${oldest.who}|${oldest.key}`)
    }

    try {
      for (const [step, op] of sequence.entries()) {
        if (op.kind === 'finish') { await finish(); continue }
        const label = `step ${step} ${op.kind} principal ${op.who} key ${op.key} body ${op.body}`
        const id = `${op.who}|${op.key}`
        if (op.kind === 'hold' && !model.has(id)) {
          // The model says this one executes: hold it in the handler.
          const gateId = randomUUID()
          let started!: () => void
          let release!: () => void
          const hasStarted = new Promise<void>((resolve) => { started = resolve })
          gates.set(gateId, { started, wait: new Promise<void>((resolve) => { release = resolve }) })
          const response = send(op.who, op.key, op.body, gateId)
          held.push({ who: op.who, key: op.key, response, release })
          const first = await Promise.race([hasStarted.then(() => null), response])
          assert.equal(first, null, `${label}: expected to execute and be held, but was answered ${first?.statusCode ?? ''} ${first?.body ?? ''}`)
          model.set(id, { state: 'held', body: op.body, response: null })
          continue
        }
        check(await send(op.who, op.key, op.body, null), op.who, op.key, op.body, label)
      }
    } finally {
      // Let every held handler finish, so nothing outlives the run even when it failed.
      while (held.length > 0) await finish()
    }

    for (const [id, entry] of model) {
      const [who, key] = id.split('|').map(Number) as [0 | 1, number]
      const name = `${prefix}${KEYS[key] ?? ''}`
      assert.equal(executions.get(`${who}|${name}`), 1, `${id}: executed exactly once`)
      const record = await store.get({ scope: pair[who], key: name })
      assert.equal(record?.state, 'completed', `${id}: the record is completed`)
      if (record?.state === 'completed') assert.equal(record.response.body?.toString(), entry.response, `${id}: the record holds its own response`)
    }
    assert.equal([...executions.values()].reduce((a, b) => a + b, 0), model.size, 'no execution the model did not predict')
  }), fcParams(seed, numRuns))

  t.ok(answers.executed > 0 && answers.replayed > 0 && answers.conflict > 0 && answers.mismatch > 0,
    `every kind of answer occurred: ${JSON.stringify(answers)}`)
  t.same(log.lines, [], 'nothing was logged at error level')
}

t.test('memory store: no sequence lets one principal replay, block or poison the other\'s keys', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  await isolationProperty(t, store, 150, 0x5c09e)
})

t.test('postgres store: no sequence lets one principal replay, block or poison the other\'s keys', async (t) => {
  const pg = postgresFixture(t)
  if (pg === null) return
  await isolationProperty(t, await pg.store('isolation'), 40, 0x5c09e)
})
