import type { ClaimLine, ExecStartLine, RequestLine, ResolveLine, StoreCallLine } from './evidence.js'
import { recordId, type Attempt, type FaultEvent, type History, type Incarnation, type Intervention, type Operation } from './history.js'
import { WORKER_INSTANCE_BASE } from './queue.js'
import type { Scenario } from './scenario-routes.js'

/**
 * The executions of every key, rebuilt from the evidence logs (evidence.ts), and the invariants
 * and counters that need them (checker.ts runs them with the others).
 *
 * An execution is one run of a handler that owned its key: from its start to the first of
 * - the store call that ended its ownership (complete, release or hold, whatever it returned),
 * - its process's death (SIGKILL or crash: the incarnation's end),
 * - else the end of everything it did (handler, stream, response, its last store call).
 * Its token (from the claim that preceded it on the same process) ties it to its store calls.
 */

export const BOUNDARIES = [
  /** A retry of a key arrived while the handler of an execution whose client had left still ran. */
  'retry-while-abandoned-handler-ran',
  /** A streamed answer took longer than its lease. */
  'stream-outlived-lease',
  /** A handler ran longer than its route's short ttl. */
  'handler-outlived-ttl',
  /** A retry of a key held for the reconciler arrived after the record's ttl, before the reconciler resolved it. */
  'held-past-ttl',
  /** A retry took over a key whose owner was still running but cut from the database. */
  'partitioned-owner-taken-over',
  /** An owner called step() after another execution had taken its key over or it was force-released. */
  'step-after-takeover',
  /** An atomic claim found its key's lock held by the original's open transaction: answered in progress at once, without waiting for it. */
  'atomic-claim-found-key-busy',
  /** An atomic claim made while the records table was locked (as DDL locks it) waited for the lock and acquired its key: no 409 for a key nobody held. */
  'table-lock-not-a-duplicate',
  /** A duplicate that arrived on another instance while the original ran, waited, and was answered with its replay after it completed. */
  'waiter-answered-across-instances',
  /** Of those, in atomic mode. */
  'atomic-waiter-answered-across-instances',
  /** Of those, on an instance whose settlement listener was killed while it waited. */
  'waiter-outlived-listener-loss',
  /** The queue door: a job whose worker was killed mid-run (fn started), then taken over by a later run of its key. */
  'job-taken-over-after-kill',
  /** A job delivered again (its visibility timeout ended) while its original run still ran: OperationInProgressError or a replay after waiting. */
  'job-redelivered-while-running',
  /** A job delivered to two workers at once: the one that did not run got OperationInProgressError or a replay, while the other ran. */
  'job-delivered-to-two-workers',
  /** A delivery of a job that started after its value was recorded, answered with the recorded value (replayed). */
  'job-replayed-after-completion'
] as const
export type Boundary = typeof BOUNDARIES[number]

/** The boundaries of the queue door (queue.ts), which runs in the full and quick modes. */
export const QUEUE_BOUNDARIES: readonly Boundary[] = ['job-taken-over-after-kill', 'job-redelivered-while-running', 'job-delivered-to-two-workers', 'job-replayed-after-completion']

/** The scenarios (or the queue door) that cross each boundary: a run without them does not have to. */
export const BOUNDARY_SCENARIOS: Readonly<Record<Boundary, ReadonlyArray<Scenario | 'queue'>>> = {
  'retry-while-abandoned-handler-ran': ['abandon'],
  'stream-outlived-lease': ['stream', 'stream-paused'],
  'handler-outlived-ttl': ['slow-ttl'],
  'held-past-ttl': ['held'],
  'partitioned-owner-taken-over': ['steps-partition'],
  'step-after-takeover': ['steps-force', 'steps-partition'],
  'atomic-claim-found-key-busy': ['atomic-duplicate'],
  'table-lock-not-a-duplicate': ['atomic-duplicate'],
  'waiter-answered-across-instances': ['wait-lease', 'wait-atomic'],
  'atomic-waiter-answered-across-instances': ['wait-atomic'],
  'waiter-outlived-listener-loss': ['wait-lease', 'wait-atomic'],
  'job-taken-over-after-kill': ['queue'],
  'job-redelivered-while-running': ['queue'],
  'job-delivered-to-two-workers': ['queue'],
  'job-replayed-after-completion': ['queue']
}

export type ExecutionViolationKind =
  | 'concurrent-execution'
  | 'execution-after-record'
  | 'execution-while-held'
  | 'stale-step'
  | 'unfenced-step'

export interface StepTrace {
  readonly name: string
  readonly calledAt: number
  /** When `fn` started (before calledAt when the handler ran the effect itself first). */
  ranAt: number | null
  refusedAt: number | null
}

export interface Execution {
  readonly id: string
  readonly instance: number
  readonly pid: number
  readonly scope: string
  readonly key: string
  readonly route: string
  readonly leaseMs: number
  readonly ttlMs: number
  readonly start: number
  /** The claim that made it the owner (null when the log has none: a torn line). */
  readonly claim: ClaimLine | null
  readonly transactional: boolean
  readonly takeover: boolean
  /** The store call that ended its ownership. */
  readonly settle: StoreCallLine | null
  readonly renewals: readonly StoreCallLine[]
  readonly end: number
  readonly endedBy: 'settled' | 'died' | 'finished' | 'still running'
  readonly handlerEnd: number | null
  readonly clientGoneAt: number | null
  readonly stream: { readonly start: number, readonly end: number | null } | null
  readonly steps: readonly StepTrace[]
  /** Every store call made with its token (for the fence a step relied on). */
  readonly calls: readonly StoreCallLine[]
}

/**
 * Why a second execution of a key ran while an earlier one still did, when that was allowed: an
 * operator force-released it; a database fault or a partition cut the owner off; or the owner kept
 * renewing but its store calls took longer than the lease (store-too-slow) or its process was
 * frozen (owner-stalled), which is the same for the lease: the owner could not renew.
 */
export type OverlapReason = 'force-released' | 'cut-from-db' | 'store-too-slow' | 'owner-stalled'

export interface ExecutionStats {
  readonly executions: number
  /** Executions of a key that had run before, by why that was allowed. */
  readonly reexecutions: Readonly<Record<'after-release' | 'after-retention' | 'resumed-by-reconciler' | 'after-dead-owner' | OverlapReason | 'after-hold' | 'after-lapsed-owner', number>>
  readonly takeovers: number
  readonly clientDisconnects: number
  readonly handlersOutlivingLease: number
  readonly holds: number
  readonly forceReleases: number
  readonly partitions: number
  readonly stepsRefused: number
  /** Of those, steps whose fn ran on a proven key and whose record reached the store after the lease ran out (fencedThenTooSlow). */
  readonly stepsRefusedAfterFence: number
  /** What the claims that timed out at 1 ms and were tried again answered (their claim line's outcome). */
  readonly boundaries: Readonly<Record<Boundary, number>>
}

export interface ExecutionFinding {
  readonly kind: ExecutionViolationKind
  readonly scope: string
  readonly key: string
  readonly message: string
}

/** Ms of rounding between processes' clocks the rules allow (every line is rounded to the ms). */
const SLACK_MS = 20
/** A ttl below this is a short one (the scenario routes'); the app's default is 24 h. */
const SHORT_TTL_LIMIT_MS = 60_000
const DATABASE_FAULTS = new Set(['pg-terminate', 'pg-restart', 'db-latency', 'db-reset', 'db-blackhole'])
const PARTITIONS = new Set(['db-blackhole'])
/** A healed partition delivers what it held at once (the connections stay up): a short settling time. */
const PARTITION_SETTLE_MS = 100

export function rebuildExecutions (history: History): Execution[] {
  const evidence = history.evidence
  const claims = new Map<string, ClaimLine[]>()
  const calls = new Map<string, StoreCallLine[]>()
  const requests = new Map<string, RequestLine[]>()
  const starts: ExecStartLine[] = []
  for (const line of evidence) {
    switch (line.ev) {
      case 'claim': {
        if (line.outcome !== 'acquired') break
        push(claims, `${line.pid}\n${recordId(line.scope, line.key)}`, line)
        break
      }
      case 'renew': case 'complete': case 'release': case 'hold': case 'loadSteps': case 'saveStep':
        push(calls, line.token, line)
        break
      case 'exec-start':
        starts.push(line)
        break
      case 'resolve': case 'plant': case 'stall':
        break
      default:
        push(requests, `${line.pid}\n${line.req}`, line)
    }
  }
  const deaths = new Map<number, Incarnation>()
  for (const incarnation of history.incarnations) deaths.set(incarnation.pid, incarnation)

  const used = new Set<ClaimLine>()
  const executions: Execution[] = []
  for (const start of starts) {
    // The claim that preceded this handler on its process: the latest one not yet taken.
    const candidates = claims.get(`${start.pid}\n${recordId(start.scope, start.key)}`) ?? []
    let claim: ClaimLine | null = null
    for (const candidate of candidates) if (candidate.end <= start.t + 1 && !used.has(candidate)) claim = candidate
    if (claim !== null) used.add(claim)
    const mine = claim?.token === null || claim === null ? [] : calls.get(claim.token) ?? []
    const renewals = mine.filter((call) => call.ev === 'renew')
    const settle = mine.find((call) => (call.ev === 'complete' || call.ev === 'release' || call.ev === 'hold') && call.ok !== null) ?? null

    const lines = requests.get(`${start.pid}\n${start.req}`) ?? []
    let handlerEnd: number | null = null
    let clientGoneAt: number | null = null
    let responseClosed: number | null = null
    let stream: { start: number, end: number | null } | null = null
    const steps: StepTrace[] = []
    const openStep = (name: string): StepTrace | undefined => steps.findLast((step) => step.name === name && step.refusedAt === null)
    for (const line of lines) {
      switch (line.ev) {
        case 'exec-end': handlerEnd = line.t; break
        case 'client-gone': clientGoneAt ??= line.t; break
        case 'response-close': responseClosed = line.t; break
        case 'stream-start': stream = { start: line.t, end: null }; break
        case 'stream-end': if (stream !== null) stream.end = line.t; break
        case 'step-call': {
          // The planted step-before-fence runs the effect before calling step(): that run is this call's.
          const ranFirst = steps.findLast((step) => step.name === line.name && step.calledAt === Infinity)
          if (ranFirst !== undefined) (ranFirst as { calledAt: number }).calledAt = line.t
          else steps.push({ name: line.name, calledAt: line.t, ranAt: null, refusedAt: null })
          break
        }
        case 'step-run': {
          const step = openStep(line.name)
          if (step !== undefined && step.ranAt === null) step.ranAt = line.t
          else steps.push({ name: line.name, calledAt: Infinity, ranAt: line.t, refusedAt: null })
          break
        }
        case 'step-refused': {
          const step = openStep(line.name)
          if (step !== undefined) step.refusedAt = line.t
          break
        }
        default: break
      }
    }
    const incarnation = deaths.get(start.pid)
    const death = incarnation?.endedAt ?? Infinity
    let end: number
    let endedBy: Execution['endedBy']
    if (settle !== null) {
      end = settle.end
      endedBy = 'settled'
    } else if (handlerEnd !== null) {
      end = Math.max(handlerEnd, stream?.end ?? -Infinity, responseClosed ?? -Infinity, ...mine.map((call) => call.end))
      endedBy = 'finished'
    } else {
      end = Infinity
      endedBy = 'still running'
    }
    if (death < end) {
      end = death
      endedBy = 'died'
    }
    executions.push({
      id: `${start.pid}/${start.req}`,
      instance: start.instance,
      pid: start.pid,
      scope: start.scope,
      key: start.key,
      route: start.route,
      leaseMs: start.leaseMs,
      ttlMs: start.ttlMs,
      start: start.t,
      claim,
      transactional: claim?.transactional === true,
      takeover: claim?.takeover === true,
      settle,
      renewals,
      end,
      endedBy,
      handlerEnd,
      clientGoneAt,
      stream,
      steps,
      calls: mine
    })
  }
  return executions
}

/** Time windows in which an instance could not rely on its database: global faults, and partitions of it alone. */
function cutWindows (history: History): (instance: number, from: number, to: number) => { cut: boolean, partition: boolean, what: string } {
  const global = history.faults.filter((fault): fault is FaultEvent & { from: number, to: number } =>
    DATABASE_FAULTS.has(fault.kind) && fault.from !== undefined && fault.to !== undefined)
  const partitions = history.interventions.filter((intervention) => intervention.kind === 'partition')
  return (instance, from, to) => {
    const overlapping = global.filter((fault) => fault.from <= to && fault.to >= from)
    const mine = partitions.filter((partition) => partition.instance === instance && partition.from <= to && partition.to + PARTITION_SETTLE_MS >= from)
    const partition = mine.length > 0 || overlapping.some((fault) => PARTITIONS.has(fault.kind))
    const what = [...overlapping.map((fault) => `${fault.kind} ${fmt(fault.from)}–${fmt(fault.to)}`), ...mine.map((p) => `partition of instance ${instance} ${fmt(p.from)}–${fmt(p.to)}`)].join(', ')
    return { cut: overlapping.length > 0 || mine.length > 0, partition, what }
  }
}

export function checkExecutions (history: History, executions: readonly Execution[]): { findings: ExecutionFinding[], stats: ExecutionStats } {
  const findings: ExecutionFinding[] = []
  const flag = (kind: ExecutionViolationKind, exec: Execution, message: string): void => {
    findings.push({ kind, scope: exec.scope, key: exec.key, message })
  }
  const cutAt = cutWindows(history)
  const byKey = new Map<string, Execution[]>()
  for (const exec of executions) push(byKey, recordId(exec.scope, exec.key), exec)
  const interventionsOf = new Map<string, Intervention[]>()
  for (const intervention of history.interventions) push(interventionsOf, recordId(intervention.scope, intervention.key), intervention)
  const resolutionsOf = new Map<string, ResolveLine[]>()
  for (const line of history.evidence) if (line.ev === 'resolve') push(resolutionsOf, recordId(line.scope, line.key), line)
  const opOf = new Map<string, Operation>()
  for (const op of history.operations) opOf.set(recordId(op.scope, op.key), op)
  const attemptsOf = new Map<number, Attempt[]>()
  for (const attempt of history.attempts) push(attemptsOf, attempt.op, attempt)

  const reexecutions = { 'after-release': 0, 'after-retention': 0, 'resumed-by-reconciler': 0, 'after-dead-owner': 0, 'force-released': 0, 'cut-from-db': 0, 'store-too-slow': 0, 'owner-stalled': 0, 'after-hold': 0, 'after-lapsed-owner': 0 }
  const stallsOf = new Map<number, Array<{ t: number, end: number }>>()
  for (const line of history.evidence) if (line.ev === 'stall') push(stallsOf, line.pid, line)
  const boundaries = Object.fromEntries(BOUNDARIES.map((boundary) => [boundary, 0])) as Record<Boundary, number>
  // Processes the harness killed (SIGKILL), by pid: a worker's run they ended was interrupted mid-job.
  const killed = new Set(history.incarnations.filter((incarnation) => incarnation.end === 'killed').map((incarnation) => incarnation.pid))
  let stepsRefusedAfterFence = 0
  // The atomic-duplicate scenario's boundaries, from the claims themselves: whether either path ran
  // the handler twice is for the rules below, which see every execution of the key.
  for (const line of history.evidence) {
    if (line.ev !== 'claim' || !line.transactional) continue
    if (line.outcome === 'in_progress') boundaries['atomic-claim-found-key-busy']++
    const lockedMeanwhile = (interventionsOf.get(recordId(line.scope, line.key)) ?? []).some((intervention) =>
      intervention.kind === 'table-lock' && intervention.effective && line.t < intervention.to && line.end > intervention.from)
    if (line.outcome === 'acquired' && lockedMeanwhile) boundaries['table-lock-not-a-duplicate']++
  }

  for (const [id, list] of byKey) {
    list.sort((a, b) => a.start - b.start)
    const forced = (interventionsOf.get(id) ?? []).filter((intervention) => intervention.kind === 'force-release' && intervention.effective)
    const resolutions = (resolutionsOf.get(id) ?? []).filter((line) => line.action !== 'leave')
    const op = opOf.get(id)
    const attempts = op === undefined ? [] : (attemptsOf.get(op.id) ?? []).filter((attempt) => !attempt.reuse)
    // The first replayed 2xx: from then on the key has a completed record (long-ttl routes, or one the reconciler completed).
    const firstReplay = attempts.filter((a) => a.outcome.kind === 'response' && a.outcome.replayed && a.outcome.status < 300).map((a) => a.endedAt).sort((a, b) => a - b)[0] ?? Infinity
    const reconcilerCompleted = resolutions.find((line) => line.action === 'complete')?.t ?? Infinity

    for (let i = 0; i < list.length; i++) {
      const b = list[i] as Execution
      const bClaimStart = b.claim?.t ?? b.start
      const bClaimEnd = b.claim?.end ?? b.start
      let judged = false
      // One finding per rule for this execution, however many earlier ones it contradicts.
      const flagged = new Set<ExecutionViolationKind>()
      const flagOnce = (kind: ExecutionViolationKind, message: string): void => {
        if (flagged.has(kind)) return
        flagged.add(kind)
        flag(kind, b, message)
      }
      for (let j = 0; j < i; j++) {
        const a = list[j] as Execution
        // A release is tried again when its answer is lost, and the lost one may have been applied:
        // the key may be free from the first attempt on, whatever a later attempt answers.
        const gaveUp = Math.min(a.settle?.t ?? Infinity, releaseAttempt(a)?.t ?? Infinity)
        const ownedUntil = a.endedBy === 'died' ? a.end : Number.isFinite(gaveUp) ? gaveUp : a.end
        if (bClaimEnd < ownedUntil - SLACK_MS) {
          // B became owner while A still ran and had not given the key up.
          judged = true
          const force = forced.find((f) => f.to >= (a.claim?.t ?? a.start) && f.from <= bClaimEnd)
          if (force !== undefined) {
            reexecutions['force-released']++
            continue
          }
          const lastFence = Math.max(a.claim?.t ?? a.start, ...a.renewals.filter((r) => r.ok === true && r.t <= bClaimEnd).map((r) => r.t))
          if (!a.transactional && lastFence + a.leaseMs > bClaimEnd + SLACK_MS) {
            flagOnce('concurrent-execution', `${describe(b)} became owner at ${fmt(bClaimEnd)} while ${describe(a)} still ran (until ${fmtEnd(a)}) on a live lease: its renewal at ${fmt(lastFence)} held the key until ${fmt(lastFence + a.leaseMs)}`)
            continue
          }
          const cut = cutAt(a.instance, a.transactional ? (a.claim?.t ?? a.start) : lastFence, bClaimEnd)
          if (cut.cut) {
            reexecutions['cut-from-db']++
            if (cut.partition) boundaries['partitioned-owner-taken-over']++
            continue
          }
          if (!a.transactional) {
            const kept = keptRenewing(a, lastFence, bClaimEnd, stallsOf.get(a.pid) ?? [])
            if (kept !== null) {
              reexecutions[kept]++
              continue
            }
          }
          const after = a.renewals.filter((r) => r.t > lastFence && r.t <= bClaimEnd)
          flagOnce('concurrent-execution', `${describe(b)} became owner at ${fmt(bClaimEnd)}${b.takeover ? ' (takeover)' : ''} while ${describe(a)} still ran (until ${fmtEnd(a)}), alive and not cut from the database: ` +
            (a.transactional ? 'its transaction was open' : `its last renewal was at ${fmt(lastFence)}, ${after.length === 0 ? 'none after it' : `then ${after.map((r) => `${fmt(r.t)} ${String(r.ok)}`).join(', ')}`}`) +
            (a.clientGoneAt === null ? '' : `; its client left at ${fmt(a.clientGoneAt)}`) +
            (a.stream === null ? '' : `; its stream started at ${fmt(a.stream.start)}`))
          continue
        }
        if (j === i - 1 && !judged) {
          // Sequential: why the key could run again.
          if (a.endedBy === 'died') reexecutions['after-dead-owner']++
          else if ((a.settle?.ev === 'release' && a.settle.ok === true) || (releaseAttempt(a)?.t ?? Infinity) < bClaimEnd) reexecutions['after-release']++
          else if (resolutions.some((line) => line.action === 'resume' && line.t > a.start && line.t < bClaimEnd)) reexecutions['resumed-by-reconciler']++
          else if (a.settle?.ev === 'complete' && a.settle.ok === true) reexecutions['after-retention']++
          else if (a.settle?.ev === 'hold' && a.settle.ok === true) reexecutions['after-hold']++
          else reexecutions['after-lapsed-owner']++
        }

        // A completed record keeps answering for its retention: no new execution meanwhile.
        if (a.settle?.ev === 'complete' && a.settle.ok === true && bClaimStart > a.settle.end && bClaimEnd < a.settle.t + a.ttlMs - SLACK_MS) {
          flagOnce('execution-after-record', `${describe(b)} ran at ${fmt(b.start)}, but ${describe(a)} recorded the outcome at ${fmt(a.settle.t)} with a ttl of ${a.ttlMs} ms`)
        }
        // A held record waits for the reconciler (or an operator): no new execution meanwhile.
        if (a.settle?.ev === 'hold' && a.settle.ok === true && bClaimStart > a.settle.end) {
          const resolved = Math.min(
            ...resolutions.filter((line) => line.t > a.settle!.t).map((line) => line.t),
            ...forced.filter((f) => f.from > a.settle!.t).map((f) => f.from)
          )
          if (bClaimEnd < resolved) {
            flagOnce('execution-while-held', `${describe(b)} ran at ${fmt(b.start)} while the key was held for the reconciler since ${fmt(a.settle.t)} by ${describe(a)} (${Number.isFinite(resolved) ? `resolved at ${fmt(resolved)}` : 'never resolved'})`)
          }
        }
      }
      // Long retention (or a record completed by the reconciler): after a replay was seen, nothing runs again.
      if ((b.ttlMs >= SHORT_TTL_LIMIT_MS || reconcilerCompleted < firstReplay) && bClaimStart > firstReplay) {
        flagOnce('execution-after-record', `${describe(b)} ran at ${fmt(b.start)}, after a client got a replay of the recorded outcome at ${fmt(firstReplay)}`)
      }

      // Steps: never after a later execution started, never refused after its effect ran.
      const laterStart = list.filter((other) => other.start > b.start).map((other) => other.start)
      const superseded = Math.min(...laterStart, ...forced.filter((f) => f.from > b.start).map((f) => f.from))
      for (const step of b.steps) {
        if (step.calledAt > superseded && Number.isFinite(step.calledAt)) boundaries['step-after-takeover']++
        if (step.ranAt !== null) {
          const later = Math.min(...laterStart.filter((t) => t < step.ranAt!))
          const raced = forced.some((f) => f.from >= step.calledAt && f.from <= step.ranAt!)
          if (Number.isFinite(later) && !raced) {
            flag('stale-step', b, `${describe(b)} ran step "${step.name}" at ${fmt(step.ranAt)}, after a later execution of the key started at ${fmt(later)}; ${fenceOf(b, step)}`)
          }
          if (step.refusedAt !== null) {
            const duringFn = forced.some((f) => f.from >= step.ranAt! && f.from <= step.refusedAt!) || cutAt(b.instance, step.ranAt, step.refusedAt).cut
            if (!duringFn && fencedThenTooSlow(b, step)) stepsRefusedAfterFence++
            else if (!duringFn) flag('unfenced-step', b, `${describe(b)} ran step "${step.name}" at ${fmt(step.ranAt)}, then step() threw LeaseLostError at ${fmt(step.refusedAt)}: the effect ran without the key; ${fenceOf(b, step)}`)
          }
        }
      }

      // The boundaries this execution crossed.
      if (b.clientGoneAt !== null) {
        const runningUntil = b.handlerEnd ?? b.end
        boundaries['retry-while-abandoned-handler-ran'] += attempts.filter((attempt) => attempt.startedAt > b.clientGoneAt! && attempt.startedAt < runningUntil).length
      }
      if (b.stream !== null && (b.stream.end ?? b.end) - b.stream.start > b.leaseMs) boundaries['stream-outlived-lease']++
      const claimedAt = b.claim?.t ?? b.start
      if (b.ttlMs < SHORT_TTL_LIMIT_MS && (b.handlerEnd ?? b.end) - claimedAt > b.ttlMs) boundaries['handler-outlived-ttl']++
      if (b.settle?.ev === 'hold' && b.settle.ok === true) {
        const resolved = Math.min(...resolutions.filter((line) => line.t > b.settle!.t).map((line) => line.t), ...forced.filter((f) => f.from > b.settle!.t).map((f) => f.from))
        if (attempts.some((attempt) => attempt.startedAt > claimedAt + b.ttlMs && attempt.startedAt < resolved)) boundaries['held-past-ttl']++
      }
    }
    if (op?.door === 'queue') countQueueBoundaries(list, attempts, reconcilerCompleted, killed, boundaries)
    if (op?.scenario === 'wait-lease' || op?.scenario === 'wait-atomic') {
      countWaiters(op, list, attempts, (interventionsOf.get(id) ?? []).filter((intervention) => intervention.kind === 'listener-kill' && intervention.effective), boundaries)
    }
  }

  return {
    findings,
    stats: {
      executions: executions.length,
      reexecutions,
      takeovers: executions.filter((exec) => exec.takeover).length,
      clientDisconnects: executions.filter((exec) => exec.clientGoneAt !== null).length,
      handlersOutlivingLease: executions.filter((exec) => !exec.transactional && exec.handlerEnd !== null && exec.handlerEnd - exec.start > exec.leaseMs).length,
      holds: executions.filter((exec) => exec.settle?.ev === 'hold' && exec.settle.ok === true).length,
      forceReleases: history.interventions.filter((intervention) => intervention.kind === 'force-release' && intervention.effective).length,
      partitions: history.interventions.filter((intervention) => intervention.kind === 'partition').length,
      stepsRefused: executions.reduce((sum, exec) => sum + exec.steps.filter((step) => step.refusedAt !== null).length, 0),
      stepsRefusedAfterFence,
      boundaries
    }
  }
}

/**
 * The waiting duplicates of a wait-lease or wait-atomic operation: attempts on another instance than
 * the execution that completed the key, begun before its completion and answered after it with the
 * replay. They waited for the original's settlement (the store's notice, or the pre-filter's copy).
 */
function countWaiters (op: Operation, list: readonly Execution[], attempts: readonly Attempt[], listenerKills: readonly Intervention[], boundaries: Record<Boundary, number>): void {
  const completed = list.find((e) => e.settle?.ev === 'complete' && e.settle.ok === true)
  if (completed?.settle === null || completed?.settle === undefined) return
  const settledAt = completed.settle.t
  for (const attempt of attempts) {
    const outcome = attempt.outcome
    if (outcome.kind !== 'response' || !outcome.replayed || outcome.status >= 300) continue
    if (attempt.instance === completed.instance || attempt.startedAt >= settledAt || attempt.endedAt < settledAt) continue
    boundaries['waiter-answered-across-instances']++
    if (op.mode === 'atomic') boundaries['atomic-waiter-answered-across-instances']++
    if (listenerKills.some((kill) => kill.instance === attempt.instance && kill.from > attempt.startedAt && kill.from < settledAt)) boundaries['waiter-outlived-listener-loss']++
  }
}

/**
 * The queue door's boundaries crossed by one job (its executions, in start order, and its
 * deliveries): whether the store kept it to one run is for the rules above, which see every run.
 */
function countQueueBoundaries (runs: readonly Execution[], deliveries: readonly Attempt[], reconcilerCompleted: number, killed: ReadonlySet<number>, boundaries: Record<Boundary, number>): void {
  const refused = (attempt: Attempt): boolean => attempt.outcome.kind === 'response' &&
    (attempt.outcome.status === 409 || (attempt.outcome.replayed && attempt.outcome.status < 300))
  for (const run of runs) {
    // Killed mid-run (its fn had started, its key not settled), then a later run took the key over.
    if (run.endedBy === 'died' && killed.has(run.pid) && runs.some((later) => later.start > run.end && later.takeover)) boundaries['job-taken-over-after-kill']++
  }
  for (const delivery of deliveries) {
    if (delivery.delivery === 'visibility' && refused(delivery) &&
        runs.some((run) => run.start < delivery.startedAt && run.end > delivery.startedAt)) {
      boundaries['job-redelivered-while-running']++
    }
    if (delivery.delivery === 'duplicate' && refused(delivery) &&
        runs.some((run) => run.instance !== delivery.instance && run.start <= delivery.endedAt && run.end >= delivery.startedAt)) {
      boundaries['job-delivered-to-two-workers']++
    }
  }
  // Recorded: a run's complete that returned true, or the reconciler's completion.
  const recorded = Math.min(reconcilerCompleted, ...runs.filter((run) => run.settle?.ev === 'complete' && run.settle.ok === true).map((run) => run.settle!.end))
  boundaries['job-replayed-after-completion'] += deliveries.filter((delivery) => delivery.startedAt > recorded &&
    delivery.outcome.kind === 'response' && delivery.outcome.replayed && delivery.outcome.status < 300).length
}

/** Idle time an owner may have between two renewals: the plugin renews every third of the lease, plus timer lateness. */
const IDLE_SLACK_MS = 150

/**
 * A release the owner sent that threw (a timeout, an outage: `ok` null): it gave the key up at that
 * moment, as a release that succeeded does. The plugin releases only after its handler (and any
 * stream) ended with a definite failure, so from then on it runs nothing for the key; whether the
 * release reached the database only decides when another attempt may claim (at once, or once the
 * lease lapsed), and the late statement is fenced by the owner's token. Without this, a release
 * stuck in a pool's reconnect backoff (seen once postgres.js processes stopped dying on dropped
 * connections) counted as the owner still running until the statement returned, long after.
 */
function releaseAttempt (execution: Execution): StoreCallLine | undefined {
  if (execution.handlerEnd === null || (execution.stream !== null && execution.stream.end === null)) return undefined
  const release = execution.calls.find((call) => call.ev === 'release')
  return release !== undefined && release.t >= execution.handlerEnd ? release : undefined
}

/**
 * Whether an owner whose lease lapsed between `from` (its last successful renewal's start) and `to`
 * (the new owner's claim) kept trying: renewal calls in flight (or its process frozen) all the time
 * but for gaps no longer than the plugin's renewal interval. Then the store was too slow (or the
 * process stalled) for its lease; otherwise the owner stopped renewing (null).
 */
function keptRenewing (a: Execution, from: number, to: number, stalls: ReadonlyArray<{ t: number, end: number }>): 'store-too-slow' | 'owner-stalled' | null {
  const busy = [
    ...(a.claim === null ? [] : [{ t: a.claim.t, end: a.claim.end, stall: false }]),
    ...a.renewals.filter((r) => r.t <= to && r.end >= from).map((r) => ({ t: r.t, end: r.end, stall: false })),
    ...stalls.filter((s) => s.t <= to && s.end >= from).map((s) => ({ t: s.t, end: s.end, stall: true }))
  ].sort((x, y) => x.t - y.t)
  const idleLimit = a.leaseMs / 3 + IDLE_SLACK_MS
  let covered = from
  let stalled = false
  for (const interval of busy) {
    if (interval.t - covered > idleLimit) return null
    if (interval.end > covered) {
      covered = interval.end
      stalled ||= interval.stall
    }
    if (covered >= to) break
  }
  if (to - covered > idleLimit) return null
  return stalled ? 'owner-stalled' : 'store-too-slow'
}

/**
 * A step whose fn ran on a proven key and was refused only because the store answered the owner
 * too late: a renewal sent after the step was called came back ok before fn started, fn started
 * within one lease of that renewal's sending (so the key was the owner's when fn started), and a
 * store call of the owner sent while that lease held was answered only after it ran out (the step's
 * save or a renewal reached the database after the lease lapsed, as for a store-too-slow
 * re-execution). The effect ran fenced; its record came too late, and the next owner runs it again
 * with the same derived key. Found by a full run (postgres.js, seed 20261203): the fence answered
 * in 7 ms, fn ran, and the save, sent 41 ms later, took 323 ms. A fn run before step() was called
 * into (the step-before-fence plant) has no renewal between the call and fn: it is still flagged.
 */
function fencedThenTooSlow (exec: Execution, step: StepTrace): boolean {
  const ranAt = step.ranAt
  if (ranAt === null) return false
  const fence = exec.calls.filter((call) => call.ev === 'renew' && call.ok === true && call.t >= step.calledAt && call.end <= ranAt).at(-1)
  if (fence === undefined) return false
  const leaseEnd = fence.t + exec.leaseMs
  if (ranAt >= leaseEnd) return false
  return exec.calls.some((call) => call.t > fence.t && call.t < leaseEnd && call.end > leaseEnd)
}

/** The fenced call a step relied on: the owner's last successful renewal answered before its fn started. */
function fenceOf (exec: Execution, step: StepTrace): string {
  const ranAt = step.ranAt ?? Infinity
  const fence = exec.calls.filter((call) => call.ev === 'renew' && call.ok === true && call.end <= ranAt + 1).at(-1)
  if (fence === undefined) return 'no renewal answered before it'
  const late = ranAt - fence.t > exec.leaseMs ? `: fn started ${ranAt - fence.t} ms after that renewal was sent, past its ${exec.leaseMs} ms lease` : ''
  return `its last renewal before fn was sent at ${fmt(fence.t)} and answered at ${fmt(fence.end)} (${fence.end - fence.t} ms)${late}`
}

/** The evidence of one key, one line per event (renewals summed up), for a violation's report. */
export function evidenceHistory (history: History, executions: readonly Execution[], scope: string, key: string): Array<{ at: number, line: string }> {
  const id = recordId(scope, key)
  const events: Array<{ at: number, line: string }> = []
  for (const exec of executions) {
    if (recordId(exec.scope, exec.key) !== id) continue
    const where = `${processName(exec.instance)} pid ${exec.pid} ${exec.id.split('/')[1] ?? ''}`
    if (exec.claim !== null) events.push({ at: exec.claim.t, line: `  ${fmt(exec.claim.t)} ${where}: claim ${exec.claim.takeover ? 'took over' : 'acquired'}${exec.transactional ? ' (transaction)' : ''}` })
    events.push({ at: exec.start, line: `  ${fmt(exec.start)} ${where}: execution starts (${exec.route}, lease ${exec.leaseMs} ms, ttl ${exec.ttlMs} ms); ended ${fmtEnd(exec)}` })
    const okRenewals = exec.renewals.filter((r) => r.ok === true)
    if (exec.renewals.length > 0) events.push({ at: exec.renewals[0]?.t ?? exec.start, line: `  ${fmt(exec.renewals[0]?.t ?? exec.start)} ${where}: ${exec.renewals.length} renewal(s), ${okRenewals.length} ok, the last ok at ${okRenewals.length === 0 ? '-' : fmt(okRenewals[okRenewals.length - 1]?.t ?? 0)}; failed or lost: ${exec.renewals.filter((r) => r.ok !== true).map((r) => `${fmt(r.t)} ${String(r.ok)}`).join(', ') || 'none'}` })
    if (exec.clientGoneAt !== null) events.push({ at: exec.clientGoneAt, line: `  ${fmt(exec.clientGoneAt)} ${where}: client gone` })
    if (exec.stream !== null) events.push({ at: exec.stream.start, line: `  ${fmt(exec.stream.start)} ${where}: stream starts, ends ${exec.stream.end === null ? 'never' : fmt(exec.stream.end)}` })
    for (const step of exec.steps) {
      const at = Math.min(step.calledAt, step.ranAt ?? Infinity)
      events.push({ at, line: `  ${fmt(at)} ${where}: step "${step.name}" called ${Number.isFinite(step.calledAt) ? fmt(step.calledAt) : '-'}, fn ${step.ranAt === null ? 'not run' : `ran ${fmt(step.ranAt)}`}${step.refusedAt === null ? '' : `, refused (LeaseLostError) ${fmt(step.refusedAt)}`}` })
    }
    if (exec.handlerEnd !== null) events.push({ at: exec.handlerEnd, line: `  ${fmt(exec.handlerEnd)} ${where}: handler ends` })
    if (exec.settle !== null) events.push({ at: exec.settle.t, line: `  ${fmt(exec.settle.t)} ${where}: ${exec.settle.ev} → ${String(exec.settle.ok)}` })
  }
  for (const line of history.evidence) {
    if ((line.ev === 'resolve' || line.ev === 'plant') && recordId(line.scope, line.key) === id) {
      events.push({ at: line.t, line: `  ${fmt(line.t)} ${line.ev === 'resolve' ? `reconciler: ${line.action}` : `PLANT: ${line.what}`}` })
    }
  }
  for (const intervention of history.interventions) {
    if (recordId(intervention.scope, intervention.key) !== id) continue
    const what = intervention.kind === 'partition'
      ? `instance ${intervention.instance ?? '?'} cut from the database`
      : intervention.kind === 'table-lock'
        ? `the records table locked (${intervention.effective ? 'taken' : 'not taken: busy'})`
        : `force release (${intervention.effective ? 'deleted the in-progress record' : 'nothing to delete'})`
    events.push({ at: intervention.from, line: `  ${fmt(intervention.from)}–${fmt(intervention.to)} harness: ${what}` })
  }
  return events
}

function describe (exec: Execution): string {
  return `execution ${exec.id} (${processName(exec.instance)})`
}

/** An evidence line's `instance`: an app instance, or a job worker (queue.ts). */
export function processName (instance: number): string {
  return instance >= WORKER_INSTANCE_BASE ? `job worker ${instance - WORKER_INSTANCE_BASE}` : `instance ${instance}`
}

function fmtEnd (exec: Execution): string {
  return Number.isFinite(exec.end) ? `${fmt(exec.end)}, ${exec.endedBy}` : exec.endedBy
}

const fmt = (ms: number): string => `${(ms / 1000).toFixed(3)}s`

function push<K, V> (map: Map<K, V[]>, key: K, value: V): void {
  const list = map.get(key)
  if (list === undefined) map.set(key, [value])
  else list.push(value)
}
