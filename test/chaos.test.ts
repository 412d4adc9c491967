import { spawn } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { createServer, type Server } from 'node:http'
import type { AddressInfo } from 'node:net'
import { tmpdir } from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import t from 'tap'
import { check, keyHistory, type ViolationKind } from './chaos/checker.js'
import { FAULT_KINDS } from './chaos/faults.js'
import type { Attempt, Effect, History, Operation } from './chaos/history.js'
import { get, post } from './chaos/http.js'
import { seededRandom } from './chaos/random.js'
import type { ChaosReport } from './chaos/report.js'
import { startFaultProxy } from './helpers/fault-proxy.js'

/**
 * The chaos harness (test/chaos/): its checker must catch each kind of violation planted in a
 * history, its fault proxy must inject each fault, and a quick run against the real plugin (3
 * instances, PostgreSQL, Redis, Redis Cluster, the fake provider, every fault kind) must end with
 * no violation and with evidence that every kind of fault actually bit.
 */

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')

// ---------------------------------------------------------------------------------------------
// The checker, on synthetic histories: a clean one passes; each planted defect is reported.

const ALPHA = 'acct-alpha'
const BETA = 'acct-beta'
const atomicOp: Operation = { id: 0, scope: ALPHA, key: 'k-1', mode: 'atomic', amount: 100, reuseAmount: 150 }
const leaseOp: Operation = { id: 1, scope: BETA, key: 'k-1', mode: 'lease', amount: 200, reuseAmount: null }
const bodyOf = (op: Operation, ref: string, scope = op.scope): string => JSON.stringify({ mode: op.mode, scope, key: op.key, amount: op.amount, ref })
let clock = 0
function attempt (op: Operation, outcome: Attempt['outcome'], reuse = false): Attempt {
  clock += 10
  return { op: op.id, reuse, phase: 'load', instance: 0, startedAt: clock, endedAt: clock + 5, outcome }
}
const ok = (op: Operation, ref: string, replayed = false, scope?: string): Attempt['outcome'] =>
  ({ kind: 'response', status: 201, replayed, body: bodyOf(op, ref, scope), retryAfter: null })
const status = (code: number, body = '{}'): Attempt['outcome'] => ({ kind: 'response', status: code, replayed: false, body, retryAfter: code === 409 || code === 503 ? 1 : null })
const effect = (op: Operation, ref: string, amount = op.amount): Effect => ({ mode: op.mode, scope: op.scope, key: op.key, amount, ref })

/** Both operations answered (with a dropped reply, a 409, a replay), one effect each, the reuse refused. */
function cleanHistory (): History {
  return {
    operations: [atomicOp, leaseOp],
    attempts: [
      attempt(atomicOp, { kind: 'error', error: 'ECONNRESET' }),
      attempt(atomicOp, status(409)),
      attempt(atomicOp, ok(atomicOp, 'row-1', true)),
      attempt(atomicOp, status(422), true),
      attempt(leaseOp, status(503)),
      attempt(leaseOp, ok(leaseOp, 'ch_1')),
      attempt(leaseOp, ok(leaseOp, 'ch_1', true))
    ],
    effects: [effect(atomicOp, 'row-1'), effect(leaseOp, 'ch_1')],
    records: [
      { scope: ALPHA, key: 'k-1', state: 'completed', responseStatus: 201 },
      { scope: BETA, key: 'k-1', state: 'completed', responseStatus: 201 }
    ],
    faults: [{ kind: 'app-kill', at: 12, detail: 'instance 0 killed with 1 request(s) in flight', effective: true }],
    crashes: [{ process: 'app instance 1', at: 30, exit: '1', knownCause: 'postgres.js 3.4.9: nextWrite() on a closed socket (porsager/postgres#1208)', stderr: 'TypeError' }]
  }
}

function kinds (history: History): ViolationKind[] {
  return check(history).violations.map((violation) => violation.kind).sort()
}

t.test('checker: a clean history has no violation, and its statistics count what happened', async (t) => {
  const result = check(cleanHistory())
  t.same(result.violations, [])
  t.equal(result.stats.operations, 2)
  t.equal(result.stats.completed, 2)
  t.equal(result.stats.effects, 2)
  t.equal(result.stats.replaysReceived, 2)
  t.equal(result.stats.reusesRefused, 1)
  t.same(result.stats.outcomes, { ECONNRESET: 1, 409: 1, 201: 3, 422: 1, 503: 1 })
  t.equal(result.stats.crashes, 1, 'a crash with a known outside cause is counted')
  t.equal(result.stats.knownCrashes, 1, 'but is not a violation')
})

t.test('checker: each planted violation is reported, with its kind and key', async (t) => {
  const planted: Array<[string, ViolationKind[], (h: History) => History]> = [
    ['two effects for one key', ['duplicate-effect'], (h) => ({ ...h, effects: [...h.effects, effect(leaseOp, 'ch_2')] })],
    ['a replay whose body differs by one byte', ['inconsistent-answers'], (h) => ({
      ...h, attempts: [...h.attempts, attempt(leaseOp, { kind: 'response', status: 201, replayed: true, body: bodyOf(leaseOp, 'ch_1') + ' ', retryAfter: null })]
    })],
    ['a 2xx and no effect', ['answered-without-effect'], (h) => ({ ...h, effects: h.effects.filter((e) => e.mode !== 'lease') })],
    ['an operation never answered', ['unfinished'], (h) => ({ ...h, attempts: h.attempts.filter((a) => !(a.op === leaseOp.id && a.outcome.kind === 'response' && a.outcome.status === 201)) })],
    ['an answer carrying another scope', ['cross-scope-answer', 'inconsistent-answers'], (h) => ({ ...h, attempts: [...h.attempts, attempt(leaseOp, ok(leaseOp, 'ch_1', true, ALPHA))] })],
    ['an answer naming another effect', ['answer-mismatch', 'inconsistent-answers'], (h) => ({ ...h, attempts: [...h.attempts, attempt(leaseOp, ok(leaseOp, 'ch_9', true))] })],
    ['a reused key answered 2xx', ['reuse-accepted', 'reuse-not-refused'], (h) => ({
      ...h, attempts: h.attempts.map((a) => a.reuse ? { ...a, outcome: ok(atomicOp, 'row-1', true) } : a)
    })],
    ['a reused key executed with its other body', ['duplicate-effect', 'effect-of-other-body'], (h) => ({ ...h, effects: [...h.effects, effect(atomicOp, 'row-2', 150)] })],
    ['a reused key never refused', ['reuse-not-refused'], (h) => ({ ...h, attempts: h.attempts.filter((a) => !a.reuse) })],
    ['a record left in progress', ['stuck-in-progress'], (h) => ({ ...h, records: [{ scope: BETA, key: 'k-1', state: 'in_progress', responseStatus: null }] })],
    ['an atomic key executed twice (two fresh 2xx)', ['double-execution'], (h) => ({ ...h, attempts: [...h.attempts, attempt(atomicOp, ok(atomicOp, 'row-1')), attempt(atomicOp, ok(atomicOp, 'row-1'))] })],
    ['a 422 to the operation\'s own body', ['unexpected-status'], (h) => ({ ...h, attempts: [...h.attempts, attempt(leaseOp, status(422))] })],
    ['an effect for a key nobody used', ['unknown-effect'], (h) => ({ ...h, effects: [...h.effects, { mode: 'atomic', scope: BETA, key: 'nobody', amount: 1, ref: 'row-x' }] })],
    ['a process that died of an unknown cause', ['process-crash'], (h) => ({ ...h, crashes: [...h.crashes, { process: 'app instance 2', at: 40, exit: '1', knownCause: null, stderr: 'TypeError: x is not a function' }] })]
  ]
  for (const [name, expected, plant] of planted) {
    t.same(kinds(plant(cleanHistory())), expected, name)
  }
  // The report names the key, so its history can be printed.
  const [violation] = check(planted[0]?.[2](cleanHistory()) as History).violations
  t.match(violation, { kind: 'duplicate-effect', scope: BETA, key: 'k-1' })
})

t.test('checker: a lease-mode re-run absorbed by the provider key is counted, not a violation', async (t) => {
  const h = cleanHistory()
  const result = check({ ...h, attempts: [...h.attempts, attempt(leaseOp, ok(leaseOp, 'ch_1'))] })
  t.same(result.violations, [])
  t.equal(result.stats.leaseReruns, 1)
})

t.test('checker: the history of a key lists its attempts, the faults around them, effects and record', async (t) => {
  const text = keyHistory(cleanHistory(), ALPHA, 'k-1')
  t.match(text, /key k-1 of scope acct-alpha/)
  t.match(text, /operation #0: atomic, amount 100, reused with amount 150/)
  t.match(text, /error ECONNRESET/)
  t.match(text, /REUSE instance 0: 422/)
  t.match(text, /fault app-kill/)
  t.match(text, /effect: atomic row-1, amount 100/)
  t.match(text, /record: completed, status 201/)
  t.notMatch(text, /ch_1/, 'nothing of the other scope\'s operation with the same key string')
})

// ---------------------------------------------------------------------------------------------
// The fault proxy (test/helpers/fault-proxy.ts), against a counting HTTP server.

t.test('fault proxy: latency, dropped replies, resets, partitions, reproducible with a seed', async (t) => {
  let handled = 0
  const server: Server = createServer((req, res) => {
    handled++
    req.resume()
    req.on('end', () => res.end(`answer ${handled}`))
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  t.teardown(() => server.close())
  const proxy = await startFaultProxy({ host: '127.0.0.1', port: (server.address() as AddressInfo).port }, {}, { random: seededRandom(7) })
  t.teardown(() => proxy.close())
  const call = (timeoutMs = 2_000) => post(proxy.port, '/', {}, 'x', timeoutMs)

  t.match(await call(), { ok: true, status: 200, body: 'answer 1' }, 'no faults: forwarded')

  proxy.set({ latencyMs: 150 })
  const started = Date.now()
  t.match(await call(), { ok: true, body: 'answer 2' })
  t.ok(Date.now() - started >= 300, 'latency applies to the request and to the reply')
  proxy.set({ latencyMs: 0 })

  proxy.set({ dropReplyProbability: 1 })
  t.match(await call(), { ok: false }, 'the reply never arrives')
  t.equal(handled, 3, 'but the server handled the request')
  t.equal(proxy.stats.dropped, 1)
  proxy.set({ dropReplyProbability: 0 })

  proxy.set({ resetProbability: 1 })
  t.match(await call(), { ok: false, error: 'ECONNRESET' })
  t.equal(proxy.stats.resets, 1)
  proxy.set({ resetProbability: 0 })

  proxy.set({ blackhole: true })
  const held = call(3_000)
  await new Promise((resolve) => setTimeout(resolve, 300))
  t.equal(handled, 4, 'nothing reaches the server during the partition')
  proxy.set({ blackhole: false })
  t.match(await held, { ok: true, body: 'answer 5' }, 'held bytes are delivered once it heals')

  proxy.set({ blackhole: true })
  const cut = call(3_000)
  await new Promise((resolve) => setTimeout(resolve, 100))
  proxy.resetConnections()
  t.match(await cut, { ok: false, error: 'ECONNRESET' }, 'resetConnections() cuts open connections')
  proxy.set({ blackhole: false })
  t.match(await call(), { ok: true, body: 'answer 6' }, 'and the proxy keeps serving')
  t.match(proxy.stats, { connections: 7, resets: 2, dropped: 1 })

  // The same seed draws the same faults: 10 calls at 50% drop lose the same calls twice over.
  const pattern = async (seed: number): Promise<boolean[]> => {
    const seeded = await startFaultProxy({ host: '127.0.0.1', port: (server.address() as AddressInfo).port }, { dropReplyProbability: 0.5 }, { random: seededRandom(seed) })
    const results: boolean[] = []
    for (let i = 0; i < 10; i++) results.push((await post(seeded.port, '/', {}, 'x', 2_000)).ok)
    await seeded.close()
    return results
  }
  const first = await pattern(11)
  t.same(await pattern(11), first)
  t.ok(first.includes(true) && first.includes(false), 'some calls dropped, some answered')
})

// ---------------------------------------------------------------------------------------------
// The quick run, end to end.

t.test('quick chaos run: no violation, and every kind of fault bit', async (t) => {
  const seed = Number(process.env.CHAOS_SEED ?? Math.floor(Math.random() * 1_000_000))
  const dir = mkdtempSync(path.join(tmpdir(), 'idem-chaos-test-'))
  t.teardown(() => rmSync(dir, { recursive: true, force: true }))
  const reportFile = path.join(dir, 'report.json')
  t.comment(`seed ${seed}: reproduce with npm run chaos -- --quick --seed=${seed}`)

  const child = spawn(process.execPath, ['--import', 'tsx', 'test/chaos/run.ts', '--quick', `--seed=${seed}`, `--report=${reportFile}`], {
    cwd: ROOT,
    stdio: ['ignore', 'pipe', 'pipe']
  })
  let output = ''
  child.stdout.on('data', (chunk: Buffer) => { output += chunk.toString() })
  child.stderr.on('data', (chunk: Buffer) => { output += chunk.toString() })
  const killer = setTimeout(() => child.kill('SIGTERM'), 100_000)
  const code = await new Promise<number | null>((resolve) => child.once('close', resolve))
  clearTimeout(killer)

  t.equal(code, 0, 'the run passed', { output })
  const report = JSON.parse(readFileSync(reportFile, 'utf8')) as ChaosReport
  t.same(report.violations, [], 'no violation')
  t.ok(report.stats.operations >= 100, `${report.stats.operations} operations`)
  t.equal(report.stats.completed, report.stats.operations, 'every operation ended with a 2xx')
  t.equal(report.stats.effects, report.stats.operations, 'one effect per operation')
  t.ok(report.stats.replaysReceived > 0, 'duplicates were answered with replays')
  t.ok(report.stats.reusesRefused > 0, 'reused keys were refused')
  for (const kind of FAULT_KINDS) {
    t.ok(report.faults[kind].effective >= 1, `${kind} injected with evidence (${report.faults[kind].effective}/${report.faults[kind].injected})`)
  }
  t.same(report.faultsMissing, [])
})

t.test('http helper: a refused connection is an error, not a throw', async (t) => {
  const server = createServer()
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const port = (server.address() as AddressInfo).port
  await new Promise<void>((resolve) => server.close(() => resolve()))
  t.match(await get(port, '/', 1_000), { ok: false, error: 'ECONNREFUSED' })
})
