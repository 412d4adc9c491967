import { checkExecutions, evidenceHistory, rebuildExecutions, type ExecutionStats, type ExecutionViolationKind } from './executions.js'
import { recordId, type Attempt, type Effect, type History, type Operation, type PaymentBody } from './history.js'

/**
 * The properties a chaos run must keep, checked on its history after the drain:
 *
 * - at most one effect per (scope, key): a ledger row (atomic mode) or an executed provider charge
 *   (lease mode), and only with the body of the operation that owns the key;
 * - nothing lost: every operation ends with a 2xx, and a key answered 2xx has exactly one effect;
 * - answers consistent: every 2xx for a key is byte-identical (draft §2.6, the replay is the
 *   recorded response), names that key's own scope, key and amount, and the effect that happened;
 * - a key reused with a different body is refused with 422 and never executed (draft §2.4);
 * - 409 only while the key is in flight: an attempt answered 409 when no other attempt of its key
 *   had started before its answer came (conflict-without-original) met a conflict nobody caused:
 *   in atomic mode, a claim whose lock wait timed out on a lock that was not a duplicate's;
 * - no record stays in progress once the faults stopped and the leases ran out;
 * - no process of the system dies on its own, unless a known defect outside the plugin explains it.
 *
 * And, on the executions rebuilt from the instances' evidence logs (executions.ts), which a
 * provider's idempotency key cannot hide (a re-run that the provider answered from its own record
 * is still a second execution):
 *
 * - concurrent-execution: no execution of a key starts (its claim ends) while an earlier execution
 *   of it still runs and has not given the key up (complete, release, hold), unless that owner was
 *   dead (its process ended first: then it was not running), force-released by an operator, or cut
 *   from the database (a database fault, or a partition of its instance, covered the time between
 *   its last successful renewal and the new claim). A takeover within a lease of the owner's last
 *   successful renewal is a violation even then: the store handed over a live lease.
 * - execution-after-record: no execution starts after an earlier one recorded the outcome
 *   (complete returned true) until the route's ttl from that completion ended; on a long-ttl
 *   route (or once the reconciler completed the key), none after a client received a replay.
 * - execution-while-held: no execution starts after an owner held the key for the reconciler
 *   (hold returned true) until the reconciler resolved it (complete, release, resume) or an
 *   operator force-released it, however long after the ttl.
 * - stale-step: no step `fn` starts after a later execution of the same key started (the old
 *   owner's step must be refused by the fenced store call step() makes first), except when a force
 *   release landed between that step's call and its `fn` (the fence passed just before it).
 * - unfenced-step: no step whose `fn` ran is then refused with LeaseLostError (the effect happened
 *   without the key), unless a force release or a database fault came while `fn` ran, or the key
 *   was proven after the step's call and within a lease before `fn` and the store answered the
 *   owner only after that lease ran out (counted: executions.ts, fencedThenTooSlow).
 *
 * Re-executions that are allowed are counted by reason, and so are the lease boundaries the run
 * crossed (executions.ts, BOUNDARIES): a run that never reached one proves nothing about it.
 */

export type ViolationKind =
  | 'duplicate-effect'
  | 'unknown-effect'
  | 'effect-of-other-body'
  | 'answered-without-effect'
  | 'unfinished'
  | 'inconsistent-answers'
  | 'answer-mismatch'
  | 'cross-scope-answer'
  | 'double-execution'
  | 'unexpected-status'
  | 'conflict-without-original'
  | 'reuse-accepted'
  | 'reuse-not-refused'
  | 'stuck-in-progress'
  | 'process-crash'
  | ExecutionViolationKind

export interface Violation {
  readonly kind: ViolationKind
  readonly scope: string
  readonly key: string
  readonly message: string
}

export interface CheckStats {
  readonly operations: number
  readonly completed: number
  readonly attempts: number
  readonly effects: number
  /** Count of each attempt outcome: the status code, or the network error. */
  readonly outcomes: Readonly<Record<string, number>>
  readonly replaysReceived: number
  readonly reusesRefused: number
  /**
   * Lease mode: keys whose handler ran more than once (a takeover after a lapsed lease while the
   * first owner still ran, the documented window), absorbed by the provider's own idempotency key.
   */
  readonly leaseReruns: number
  /** Processes that died on their own, and how many of those a known outside defect explains. */
  readonly crashes: number
  readonly knownCrashes: number
  /** What the evidence logs show: executions, re-executions by reason, the lease boundaries crossed. */
  readonly executions: ExecutionStats
}

export interface CheckResult {
  readonly violations: readonly Violation[]
  readonly stats: CheckStats
}

/** Statuses an operation's own body may get on the way to its 2xx: conflicts, outages, failed attempts. */
const TRANSIENT = new Set([409, 500, 502, 503, 504])

export function check (history: History): CheckResult {
  const violations: Violation[] = []
  const flag = (kind: ViolationKind, op: { scope: string, key: string }, message: string): void => {
    violations.push({ kind, scope: op.scope, key: op.key, message })
  }

  const byId = new Map<string, Operation>()
  for (const op of history.operations) byId.set(recordId(op.scope, op.key), op)
  const attemptsOf = new Map<number, Attempt[]>()
  for (const attempt of history.attempts) {
    const list = attemptsOf.get(attempt.op)
    if (list === undefined) attemptsOf.set(attempt.op, [attempt])
    else list.push(attempt)
  }
  const effectsOf = new Map<string, Effect[]>()
  for (const effect of history.effects) {
    const id = recordId(effect.scope, effect.key)
    if (!byId.has(id)) {
      flag('unknown-effect', effect, `an effect (${effect.mode}, amount ${effect.amount}, ref ${effect.ref}) for a key no operation used`)
      continue
    }
    const list = effectsOf.get(id)
    if (list === undefined) effectsOf.set(id, [effect])
    else list.push(effect)
  }

  const outcomes: Record<string, number> = {}
  let completed = 0
  let replaysReceived = 0
  let reusesRefused = 0
  let leaseReruns = 0

  for (const op of history.operations) {
    const id = recordId(op.scope, op.key)
    const effects = effectsOf.get(id) ?? []
    const attempts = attemptsOf.get(op.id) ?? []
    if (effects.length > 1) flag('duplicate-effect', op, `${effects.length} effects: ${effects.map((e) => `${e.ref} (amount ${e.amount})`).join(', ')}`)
    for (const effect of effects) {
      if (effect.amount !== op.amount || effect.mode !== op.mode) {
        flag('effect-of-other-body', op, `effect ${effect.ref} is ${effect.mode} amount ${effect.amount}; the operation is ${op.mode} amount ${op.amount}`)
      }
    }

    const bodies = new Set<string>()
    let fresh2xx = 0
    let reuseRefused = false
    for (const attempt of attempts) {
      const outcome = attempt.outcome
      const label = outcome.kind === 'response' ? String(outcome.status) : outcome.error
      outcomes[label] = (outcomes[label] ?? 0) + 1
      if (outcome.kind !== 'response') continue
      const status = outcome.status
      if (status === 409 && !attempts.some((other) => other !== attempt && other.startedAt <= attempt.endedAt)) {
        flag('conflict-without-original', op, `${attempt.reuse ? 'the reused key' : 'the operation'} got 409 on instance ${attempt.instance} at ${fmt(attempt.startedAt)}–${fmt(attempt.endedAt)}, when no other attempt of the key had started: ${outcome.body}`)
      }
      if (attempt.reuse) {
        if (status >= 200 && status < 300) flag('reuse-accepted', op, `the reused key with amount ${op.reuseAmount ?? '?'} got ${status}: ${outcome.body}`)
        else if (status === 422) reuseRefused = true
        else if (!TRANSIENT.has(status)) flag('unexpected-status', op, `the reused key got ${status}: ${outcome.body}`)
        continue
      }
      if (status >= 200 && status < 300) {
        bodies.add(outcome.body)
        if (outcome.replayed) replaysReceived++
        else fresh2xx++
      } else if (!TRANSIENT.has(status)) {
        flag('unexpected-status', op, `the operation's own body got ${status}: ${outcome.body}`)
      }
    }
    if (reuseRefused) reusesRefused++
    if (op.reuseAmount !== null && !reuseRefused) flag('reuse-not-refused', op, `the reused key (amount ${op.reuseAmount}) never got 422`)

    if (bodies.size === 0) {
      flag('unfinished', op, `no 2xx after ${attempts.filter((a) => !a.reuse).length} attempts, ${effects.length} effect(s)`)
      continue
    }
    completed++
    if (effects.length === 0) flag('answered-without-effect', op, 'answered 2xx but no effect exists')
    if (bodies.size > 1) flag('inconsistent-answers', op, `${bodies.size} different 2xx bodies: ${[...bodies].join(' | ')}`)
    if (fresh2xx > 1) {
      // Atomic mode commits the effect with the record: two executions would be two effects.
      if (op.mode === 'atomic') flag('double-execution', op, `${fresh2xx} 2xx answers without Idempotent-Replayed`)
      else leaseReruns++
    }
    for (const text of bodies) checkBody(op, text, effects, flag)
  }

  for (const record of history.records) {
    if (record.state !== 'completed') flag('stuck-in-progress', record, `record left ${record.state} after the drain`)
  }

  for (const crash of history.crashes) {
    if (crash.knownCause === null) {
      flag('process-crash', { scope: '', key: '' }, `${crash.process} died (${crash.exit}) at ${fmt(crash.at)}, cause unknown:\n${crash.stderr}`)
    }
  }

  const executions = checkExecutions(history, rebuildExecutions(history))
  violations.push(...executions.findings)

  return {
    violations,
    stats: {
      operations: history.operations.length,
      completed,
      attempts: history.attempts.length,
      effects: history.effects.length,
      outcomes,
      replaysReceived,
      reusesRefused,
      leaseReruns,
      crashes: history.crashes.length,
      knownCrashes: history.crashes.filter((crash) => crash.knownCause !== null).length,
      executions: executions.stats
    }
  }
}

function checkBody (op: Operation, text: string, effects: readonly Effect[], flag: (kind: ViolationKind, op: Operation, message: string) => void): void {
  let body: PaymentBody
  try {
    body = JSON.parse(text) as PaymentBody
  } catch {
    flag('answer-mismatch', op, `a 2xx body is not JSON: ${text}`)
    return
  }
  if (body.scope !== op.scope) {
    flag('cross-scope-answer', op, `a 2xx body of scope ${op.scope} carries scope ${String(body.scope)}: ${text}`)
    return
  }
  if (body.key !== op.key || body.amount !== op.amount || body.mode !== op.mode) {
    flag('answer-mismatch', op, `a 2xx body does not describe this operation (${op.mode}, amount ${op.amount}): ${text}`)
    return
  }
  if (effects.length > 0 && !effects.some((effect) => effect.ref === body.ref)) {
    flag('answer-mismatch', op, `a 2xx body names ${String(body.ref)}, which is not the effect (${effects.map((e) => e.ref).join(', ')})`)
  }
}

/** Everything the run saw of one key, in time order: for the report of a violation. */
export function keyHistory (history: History, scope: string, key: string): string {
  const id = recordId(scope, key)
  const op = history.operations.find((candidate) => recordId(candidate.scope, candidate.key) === id)
  const lines: string[] = [`key ${key} of scope ${scope}`]
  if (op === undefined) {
    lines.push('  (no operation used this key)')
  } else {
    lines.push(`  operation #${op.id}: ${op.mode}, amount ${op.amount}${op.reuseAmount === null ? '' : `, reused with amount ${op.reuseAmount}`}`)
    const attempts = history.attempts.filter((attempt) => attempt.op === op.id)
    const first = Math.min(...attempts.map((attempt) => attempt.startedAt))
    const last = Math.max(...attempts.map((attempt) => attempt.endedAt))
    // Attempts and the faults around them (from 5 s before the first attempt), in time order.
    const events: Array<{ at: number, line: string }> = attempts.map((attempt) => {
      const outcome = attempt.outcome
      const what = outcome.kind === 'error'
        ? `error ${outcome.error}`
        : `${outcome.status}${outcome.replayed ? ' replayed' : ''}${outcome.retryAfter === null ? '' : ` retry-after ${outcome.retryAfter}`} ${outcome.body.slice(0, 300)}`
      return { at: attempt.startedAt, line: `  ${fmt(attempt.startedAt)}–${fmt(attempt.endedAt)} ${attempt.phase} ${attempt.reuse ? 'REUSE ' : ''}instance ${attempt.instance}: ${what}` }
    })
    for (const fault of history.faults) {
      if (fault.at >= first - 5_000 && fault.at <= last + 1_000) events.push({ at: fault.at, line: `  ${fmt(fault.at)} fault ${fault.kind}: ${fault.detail}` })
    }
    for (const crash of history.crashes) {
      if (crash.at >= first - 5_000 && crash.at <= last + 1_000) events.push({ at: crash.at, line: `  ${fmt(crash.at)} ${crash.process} died (${crash.knownCause ?? 'cause unknown'})` })
    }
    for (const incarnation of history.incarnations) {
      const ended = incarnation.endedAt
      if (ended !== null && incarnation.end !== 'shutdown' && ended >= first - 5_000 && ended <= last + 1_000) {
        events.push({ at: ended, line: `  ${fmt(ended)} instance ${incarnation.instance} pid ${incarnation.pid} ${incarnation.end ?? 'ended'}` })
      }
    }
    events.push(...evidenceHistory(history, rebuildExecutions(history), scope, key))
    for (const event of events.sort((a, b) => a.at - b.at)) lines.push(event.line)
  }
  for (const effect of history.effects.filter((e) => recordId(e.scope, e.key) === id)) {
    lines.push(`  effect: ${effect.mode} ${effect.ref}, amount ${effect.amount}`)
  }
  for (const record of history.records.filter((r) => recordId(r.scope, r.key) === id)) {
    lines.push(`  record: ${record.state}, status ${record.responseStatus ?? '-'}`)
  }
  return lines.join('\n')
}

const fmt = (ms: number): string => `${(ms / 1000).toFixed(3)}s`
