import type { FastifyReply } from 'fastify'
import type { RequestState } from './context.js'
import { sendProblem, type ProblemAnswer, type ProblemBodies, type ProblemOptions } from './problems.js'
import type { IdempotencyPrefilter } from './prefilter.js'
import type { IdempotencyStore } from './store.js'
import type { Waiters } from './waiters.js'

/** What every hook of one plugin registration shares. */
export interface Engine {
  readonly store: IdempotencyStore
  readonly prefilter: IdempotencyPrefilter | null
  readonly waiters: Waiters
  readonly problems: ProblemBodies
  readonly problemOptions: ProblemOptions
}

/** Sends a problem answer; the request is then never recorded (it is not the key's outcome). */
export function answer (engine: Engine, state: RequestState | null, reply: FastifyReply, problem: ProblemAnswer): FastifyReply {
  if (state !== null) state.phase = 'answered'
  return sendProblem(reply, engine.problems, engine.problemOptions, problem)
}

/** Log fields for a decision: the key is truncated, since it may be guessable by whoever reads logs. */
export function decision (state: RequestState, outcome: string): { idempotency: { outcome: string, scope: string, key: string } } {
  const key = state.key.length > 12 ? `${state.key.slice(0, 8)}…` : state.key
  return { idempotency: { outcome, scope: state.scope, key } }
}
