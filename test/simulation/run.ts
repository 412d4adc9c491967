import diagnostics from 'node:diagnostics_channel'
import type { FastifyReply, FastifyRequest } from 'fastify'
import { kState, stateOf } from '../../lib/fastify/request-state.js'
import { DECISION_CHANNEL, type DecisionEvent, type IdempotentOperation } from '../../lib/index.js'
import { seededRandom } from '../chaos/random.js'
import { clock, now, settle } from './clock.js'
import { CALM, Network, type CallRecord } from './network.js'
import { planted, type Plant } from './plants.js'
import { PrefilterModel, prefilterOn } from './prefilter-model.js'
import { short, StoreModel, storeOn, type Effect, type TransactionHandle } from './store-model.js'
import { Trace } from './trace.js'
import { EFFECTFUL, isAtomic, isJob, probes, workload, type Plan, type Route } from './workload.js'
import { JOB_OPTIONS, LEASE, requestContext, type Current, type Instance } from './world.js'

/*
 * One run of the simulation: a seed's workload against the instances, on the virtual clock, then
 * the invariants. Every step fires the earliest timer (a request arriving, a store call reaching
 * the store or answering, a handler's work, a lease renewal, a deadline, a client leaving) and lets
 * the code run until it waits again. Once every request is answered, the network heals and one
 * probe per key (the first request again, retried like a client on 409 or 503) must get a definite
 * answer; then everything must come to rest: no timer left.
 */

export interface Violation {
  readonly kind: string
  readonly detail: string
}

/** What kinds of interleavings a run went through (counted over many runs by the caller). */
export type Coverage = Record<string, boolean>

export interface RunResult {
  readonly seed: number
  readonly violations: Violation[]
  readonly coverage: Coverage
  readonly trace: Trace
  readonly steps: number
}

interface Flight {
  readonly plan: Plan
  request: FastifyRequest | null
  answered: boolean
  aborted: boolean
  status: number | null
  body: string
  replayed: boolean
  respondedAt: number | null
  abortedAt: number | null
  timedOutAt: number | null
  phaseAtTimeout: string | null
  handlerStartedAt: number | null
  /** When a claim of this request was acquired on the store, and when its answer came back. */
  acquiredAt: number | null
  acquiredAnswerAt: number | null
  /** Probes: tries so far. */
  tries: number
}

/** What a job's refusal stands for, as a route would answer it (the probes retry on 409 and 503 alike). */
const JOB_REFUSALS: Readonly<Record<string, number>> = {
  FST_IDEMPOTENCY_IN_PROGRESS: 409,
  FST_IDEMPOTENCY_MISMATCH: 422,
  FST_IDEMPOTENCY_STORE_UNAVAILABLE: 503
}

/** What a handler or a job's function uses of its operation. */
type Operation = Pick<IdempotentOperation, 'step' | 'markIndeterminate' | 'sql'>

const HORIZON_MS = 180_000
const PROBE_AFTER_MS = 2_000
const PROBE_RETRY_MS = 2_000
const PROBE_TRIES = 12
const MAX_STEPS = 200_000

/** The run in progress, for the decision channel's subscriber (subscribed once per process). */
let active: { readonly network: Network, readonly flights: Map<number, Flight>, readonly violations: Violation[], readonly trace: Trace, readonly coverage: Coverage } | null = null

diagnostics.subscribe(DECISION_CHANNEL, (message) => {
  if (active === null) return
  const event = message as DecisionEvent
  const id = Number(event.request?.headers['x-sim'])
  const flight = active.flights.get(id)
  active.trace.log(`${event.request === undefined ? `job ${event.route} ${event.key}` : `r${id}`} decision: ${event.outcome}`)
  if (event.outcome === 'conflict') {
    // A 409 is the store's word: the store answered this step that the key is in progress.
    const said = active.network.delivered.some((d) => d.operation === 'claim' && d.key === event.key && d.answer === 'in_progress')
    if (!said) active.violations.push({ kind: 'conflict-without-the-store', detail: `r${id} got 409 for ${event.key} without an in-progress answer from the store` })
  }
  if (event.outcome === 'replayed' && flight !== undefined) {
    const fromCopy = active.network.delivered.some((d) => d.operation.startsWith('p.lookup') && d.key === event.key && d.answer === 'completed')
    if (fromCopy) active.coverage.replayFromCopy = true
  }
})

export async function simulate (seed: number, instances: readonly Instance[], current: Current, plant: Plant | null): Promise<RunResult> {
  const random = seededRandom(seed)
  const work = workload(random.fork('workload'))
  const trace = new Trace(now())
  const network = new Network(random.fork('network'), work.rates, trace)
  const startedAt = now()
  network.outage = work.outage === null ? null : { from: startedAt + work.outage.from, until: startedAt + work.outage.until }
  const violations: Violation[] = []
  const coverage: Coverage = {}
  const flights = new Map<number, Flight>()
  const effects = new Map<string, Effect[]>()
  const running = new Map<string, number>()
  const model = new StoreModel({
    acquired (token, key, request, takeover) {
      const flight = request === null ? undefined : flights.get(request)
      if (takeover) coverage[flight !== undefined && isJob(flight.plan.route) ? 'jobTakeover' : 'takeover'] = true
      if (flight !== undefined) flight.acquiredAt = now()
      trace.log(`  store: ${key} ${takeover ? 'taken over' : 'acquired'} by ${short(token)}${request === null ? '' : ` for r${request}`}`)
    },
    changed (key, what, token) {
      if (what === 'held') coverage[work.plans.some((plan) => plan.key === key && isJob(plan.route)) ? 'jobHeld' : 'held'] = true
      trace.log(`  store: ${key} ${what} (${short(token)})`)
    }
  }, random.fork('tokens'))
  const prefilterModel = new PrefilterModel()
  const requestOf = (): number | null => requestContext.getStore() ?? null
  const flightOf = (request: number | null): Flight | undefined => request === null ? undefined : flights.get(request)
  current.store = planted(storeOn(model, network, requestOf), plant, {
    flightOf: (id) => {
      const flight = flightOf(id)
      return flight === undefined ? null : { route: flight.plan.route, request: flight.request, handlerStarted: flight.handlerStartedAt !== null }
    },
    requestOf,
    trace,
    lease: LEASE
  })
  current.prefilter = prefilterOn(prefilterModel, network, requestOf)
  network.onDeliver = (call: CallRecord) => {
    const flight = flightOf(call.request)
    if (flight === undefined) return
    if (call.operation === 'claim' && call.answer !== null && /^(acquired|taken over)/.test(call.answer)) {
      flight.acquiredAnswerAt = now()
      if (flight.respondedAt !== null || flight.timedOutAt !== null) coverage.claimLandedAfterAnswer = true
      const phase = flight.request === null ? null : stateOf(flight.request)?.lifecycle.phase
      if (phase === 'preempted') coverage.claimLandedWhileAnotherAnswerWentOut = true
      if (flight.abortedAt !== null) coverage.clientLeftBeforeClaim = true
    }
    if (call.operation === 'claim' && call.answer === 'in_progress' && isAtomic(flight.plan.route)) coverage.atomicInProgress = true
    if (call.operation === 'give-up') coverage.takeoverGivenBack = true
  }

  /**
   * What a handler or a job does, on either door: its effect (lease mode: when it runs, or in its
   * step; atomic mode: a write in the claim's transaction), its work, and how it ends. Throws for
   * the ends that throw; returns the others for the door to answer.
   */
  const operate = async (id: number, route: Route, context: Operation, token: string): Promise<'ok' | 'fail-500' | 'unsendable'> => {
    const flight = flights.get(id) as Flight
    const plan = flight.plan
    const atomic = isAtomic(route)
    flight.handlerStartedAt = now()
    trace.log(`r${id} handler starts (${plan.end}, ${plan.work} ms) as ${short(token)}`)
    if (!atomic) {
      const others = running.get(plan.key) ?? 0
      if (others > 0) violations.push({ kind: 'concurrent-execution', detail: `r${id} started ${plan.key}'s handler while another ran` })
      running.set(plan.key, others + 1)
    }
    let done = false
    const ended = (): void => {
      if (done) return
      done = true
      if (!atomic) running.set(plan.key, (running.get(plan.key) ?? 1) - 1)
      trace.log(`r${id} handler ends`)
    }
    const effect = (): void => {
      const list = effects.get(plan.key) ?? []
      list.push({ key: plan.key, request: id, at: now() })
      effects.set(plan.key, list)
      trace.log(`r${id} EFFECT on ${plan.key}`)
    }
    const stepped = route === '/l/steps' || route === '/j/steps'
    try {
      const effectful = EFFECTFUL.has(plan.end)
      if (!atomic && effectful && !stepped) effect()
      if (stepped) {
        await context.step('charge', () => {
          if (effectful) effect()
          return 'charged'
        })
      }
      if (plan.work > 0) await new Promise((resolve) => { setTimeout(resolve, plan.work) })
      if (atomic && effectful) (context.sql as unknown as TransactionHandle).write({ key: plan.key, request: id, at: now() })
      switch (plan.end) {
        case 'throw': throw new Error('sim: card declined')
        case 'indeterminate':
          context.markIndeterminate()
          throw new Error('sim: the provider did not answer')
        default: return plan.end
      }
    } finally {
      // The work ends here; what follows is its answer being sent (and settled).
      ended()
    }
  }

  current.handlers = {
    arrived (request) {
      const flight = flights.get(Number(request.headers['x-sim']))
      if (flight !== undefined) flight.request = request
    },
    async handle (request: FastifyRequest, reply: FastifyReply, route: Route): Promise<unknown> {
      const id = Number(request.headers['x-sim'])
      const context = request.idempotency
      if (context === null) throw new Error('sim: a protected request without request.idempotency')
      const end = await operate(id, route, context, stateOf(request)?.lifecycle.lease?.token ?? '?')
      const plan = (flights.get(id) as Flight).plan
      switch (end) {
        case 'ok': return reply.code(201).send({ charge: `r${id}`, key: plan.key })
        case 'fail-500': return reply.code(500).send({ error: 'sim: provider down' })
        case 'unsendable':
          reply.header('x-sim-bad', 'a\r\nb')
          return reply.code(201).send({ charge: `r${id}` })
      }
    },
    async job (id, route, op) {
      const end = await operate(id, route, op, '(a job)')
      const plan = (flights.get(id) as Flight).plan
      switch (end) {
        case 'ok': return { charge: `r${id}`, key: plan.key }
        case 'fail-500': throw new Error('sim: provider down')
        // What a job cannot record: its value is no JSON (a route's answer with a header Node refuses).
        case 'unsendable': return { charge: BigInt(id) }
      }
    },
    errored (request, error) {
      const id = Number(request.headers['x-sim'])
      const flight = flights.get(id)
      if (flight === undefined || error.code !== 'FST_ERR_HANDLER_TIMEOUT') return
      flight.timedOutAt = now()
      flight.phaseAtTimeout = (request as unknown as Record<symbol, { lifecycle: { phase: string } } | null>)[kState]?.lifecycle.phase ?? 'none'
      coverage[`timeoutWhile_${flight.phaseAtTimeout}`] = true
      trace.log(`r${id} handlerTimeout fires (phase ${flight.phaseAtTimeout})`)
    }
  }

  const start = (plan: Plan): void => {
    const flight: Flight = flights.get(plan.id) ?? {
      plan,
      request: null,
      answered: false,
      aborted: false,
      status: null,
      body: '',
      replayed: false,
      respondedAt: null,
      abortedAt: null,
      timedOutAt: null,
      phaseAtTimeout: null,
      handlerStartedAt: null,
      acquiredAt: null,
      acquiredAnswerAt: null,
      tries: 0
    }
    flight.tries++
    flight.answered = false
    flights.set(plan.id, flight)
    trace.log(`r${plan.id} arrives at i${plan.instance} ${plan.route} ${plan.key} amount ${plan.amount}${plan.probe ? ` (probe, try ${flight.tries})` : ''}`)
    const answered = (status: number, body: string, replayed: boolean): void => {
      flight.answered = true
      flight.status = status
      flight.body = body
      flight.replayed = replayed
      flight.respondedAt = now()
      trace.log(`r${plan.id} answered ${status}${replayed ? ' (replay)' : ''} ${body.slice(0, 80)}`)
      if (plan.probe && (status === 409 || status === 503) && flight.tries < PROBE_TRIES) {
        setTimeout(() => { start(plan) }, PROBE_RETRY_MS)
      }
    }
    const instance = instances[plan.instance] as Instance
    if (isJob(plan.route)) {
      coverage.job = true
      const { runner, run } = JOB_OPTIONS[plan.route as keyof typeof JOB_OPTIONS]
      requestContext.run(plan.id, () => {
        instance.runners[runner].run({ key: plan.key, operation: plan.route, payload: { amount: plan.amount }, scope: 'tenant', ...run }, (op) => current.handlers.job(plan.id, plan.route, op))
          .then(({ value, replayed }) => {
            if (replayed) coverage.jobReplayed = true
            answered(201, JSON.stringify(value), replayed)
          }, (err: Error & { code?: string }) => {
            const status = JOB_REFUSALS[err.code ?? ''] ?? 500
            if (status === 409) coverage.jobInProgress = true
            answered(status, err.message, false)
          })
      })
      return
    }
    const controller = plan.abortAfter === null ? null : new AbortController()
    requestContext.run(plan.id, () => {
      instance.app.inject({
        method: 'POST',
        url: plan.route,
        headers: { 'idempotency-key': `"${plan.key}"`, 'content-type': 'application/json', 'x-sim': String(plan.id) },
        payload: { amount: plan.amount },
        ...(controller === null ? {} : { signal: controller.signal })
      }).then((res) => {
        answered(res.statusCode, res.body, res.headers['idempotent-replayed'] === 'true')
      }, (err: unknown) => {
        flight.answered = true
        flight.aborted = true
        flight.respondedAt = now()
        trace.log(`r${plan.id} client gone (${(err as Error).message})`)
      })
    })
    if (controller !== null && plan.abortAfter !== null) {
      setTimeout(() => {
        if (flight.answered) return
        flight.abortedAt = now()
        if (flight.acquiredAnswerAt !== null && flight.handlerStartedAt !== null) coverage.clientLeftDuringHandler = true
        else if (flight.acquiredAnswerAt === null) coverage.clientLeftBeforeClaim = true
        trace.log(`r${plan.id} client leaves`)
        controller.abort()
      }, plan.abortAfter)
    }
  }

  active = { network, flights, violations, trace, coverage }
  const horizon = now() + HORIZON_MS
  let steps = 0
  try {
    for (const plan of work.plans) setTimeout(() => { start(plan) }, plan.arriveAt)
    const planned = work.plans.length
    let probing: Plan[] | null = null
    trace.log(`seed ${seed}: ${work.instances} instances, faults ${JSON.stringify(work.rates)}, outage ${JSON.stringify(work.outage)}${plant === null ? '' : `, planted: ${plant}`}`)
    for (;;) {
      const answered = [...flights.values()].filter((flight) => flight.answered && !flight.plan.probe).length
      if (probing === null && answered === planned) {
        network.rates = CALM
        network.outage = null
        probing = probes(work.plans, random.fork('probes'), work.instances, now() + PROBE_AFTER_MS)
        trace.log('the network heals; probes follow')
        for (const plan of probing) setTimeout(() => { start(plan) }, PROBE_AFTER_MS)
      }
      if (clock.countTimers() === 0) break
      if (now() > horizon || steps > MAX_STEPS) {
        violations.push({ kind: 'never-settled', detail: `${clock.countTimers()} timers still set at ${now()} ms (a renewal or a retry that never ends, or a request never answered)` })
        break
      }
      network.takeDelivered()
      clock.next()
      steps++
      await settle()
      for (const delivered of network.delivered) {
        if (delivered.operation.startsWith('p.lookup') && delivered.answer === 'completed' && model.records.get(delivered.key)?.state !== 'completed') {
          violations.push({ kind: 'prefilter-ahead-of-the-store', detail: `the pre-filter held a completed copy of ${delivered.key} the store does not have` })
        }
      }
    }
    check({ work, probing: probing ?? [], flights, effects, model, violations, coverage, network })
  } finally {
    active = null
  }
  return { seed, violations, coverage, trace, steps }
}

interface CheckInput {
  readonly work: ReturnType<typeof workload>
  readonly probing: readonly Plan[]
  readonly flights: Map<number, Flight>
  readonly effects: Map<string, Effect[]>
  readonly model: StoreModel
  readonly violations: Violation[]
  readonly coverage: Coverage
  readonly network: Network
}

/** The invariants, once the run came to rest. */
function check ({ work, probing, flights, effects, model, violations, coverage, network }: CheckInput): void {
  // At most one execution per key: lease mode's effects happen when the handler runs; atomic mode's
  // exist only once their transaction committed.
  const perKey = new Map<string, Effect[]>()
  for (const [key, list] of effects) perKey.set(key, [...list])
  for (const effect of model.committedEffects) perKey.set(effect.key, [...(perKey.get(effect.key) ?? []), effect])
  for (const [key, list] of perKey) {
    if (list.length > 1) violations.push({ kind: 'double-execution', detail: `${key} took effect ${list.length} times (r${list.map((e) => e.request).join(', r')})` })
  }

  for (const flight of flights.values()) {
    const { plan } = flight
    if (!flight.answered) violations.push({ kind: 'no-answer', detail: `r${plan.id} was never answered` })
    if (flight.aborted || flight.status === null) continue
    const record = model.records.get(plan.key)
    // Every success the client saw is the key's recorded outcome, and every replay is that outcome.
    if (flight.status >= 200 && flight.status < 300) {
      if (record?.state !== 'completed') {
        violations.push({ kind: 'success-not-recorded', detail: `r${plan.id} answered ${flight.status} but ${plan.key} is ${record === undefined ? 'absent' : record.held ? 'held' : record.state}` })
      } else if (record.response?.body?.toString() !== flight.body) {
        violations.push({ kind: 'answer-is-not-the-record', detail: `r${plan.id} answered ${flight.body.slice(0, 60)}; ${plan.key} recorded ${record.response?.body?.toString().slice(0, 60)}` })
      }
    }
    if (flight.replayed) coverage.replayed = true
  }

  // Every key ends completed, held for the reconciler, free, or in progress with a lapsed lease (a
  // claim whose answer was lost: nobody owns it, the same request takes it over, it expires with
  // its ttl). None is still leased once every owner has settled.
  for (const record of model.records.values()) {
    if (record.state === 'in_progress' && !record.held && record.leaseUntil > now()) {
      violations.push({ kind: 'stuck-in-progress', detail: `${record.key} is still in progress (${short(record.token)}, lease until ${record.leaseUntil}, now ${now()})` })
    }
  }
  if (model.openTransactions > 0) violations.push({ kind: 'transaction-left-open', detail: `${model.openTransactions} transactions still open` })

  // The probes' last answers are definite.
  for (const plan of probing) {
    const flight = flights.get(plan.id)
    if (flight === undefined || flight.status === null) continue
    const record = model.records.get(plan.key)
    const held = record?.state === 'in_progress' && record.held
    if ((flight.status === 409 && !held) || flight.status === 503) {
      violations.push({ kind: 'no-definite-answer', detail: `the probe of ${plan.key} still got ${flight.status} after ${flight.tries} tries on a healed network` })
    }
  }

  for (const call of network.calls) {
    if (call.operation === 'complete' && call.token !== null && network.calls.filter((other) => other.operation === 'complete' && other.token === call.token).length > 3) {
      coverage.completeFailedPastItsRetries = true
      break
    }
  }
  if (work.plans.some((plan) => isAtomic(plan.route))) coverage.atomic = true
}
