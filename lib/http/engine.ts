import type { FastifyReply } from 'fastify'
import type { RequestState } from '../core/context.js'
import type { Engine } from '../core/engine.js'
import { sendProblem, type ProblemAnswer, type ProblemBodies, type ProblemOptions } from './problems.js'

/** The core's engine, plus the registration's problem answers. */
export interface HttpEngine extends Engine {
  readonly problems: ProblemBodies
  readonly problemOptions: ProblemOptions
}

/** Sends a problem answer; the request is then never recorded (it is not the key's outcome). */
export function answer (engine: HttpEngine, state: RequestState | null, reply: FastifyReply, problem: ProblemAnswer): FastifyReply {
  state?.lifecycle.answered()
  return sendProblem(reply, engine.problems, engine.problemOptions, problem)
}
