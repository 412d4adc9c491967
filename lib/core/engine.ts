import type { FastifyReply } from 'fastify'
import type { RequestState } from './context.js'
import { sendProblem, type ProblemAnswer, type ProblemBodies, type ProblemOptions } from '../http/problems.js'
import type { FingerprintKeys } from './fingerprint-keys.js'
import type { Metrics } from './observe.js'
import type { IdempotencyPrefilter } from './prefilter.js'
import type { IdempotencyStore } from './store.js'
import type { Waiters } from './waiters.js'

/** What every hook of one plugin registration shares. */
export interface Engine {
  /** The store given (sealed when `encryption` is set): its methods are the only way to it (lib/core/store.ts). */
  readonly store: IdempotencyStore
  readonly prefilter: IdempotencyPrefilter | null
  readonly waiters: Waiters
  readonly problems: ProblemBodies
  readonly problemOptions: ProblemOptions
  /** The `metrics` option's instruments, or null (lib/core/observe.ts). */
  readonly metrics: Metrics | null
  /** MAC keys of keyed fingerprints, derived from the `encryption` option (lib/core/fingerprint-keys.ts), or null. */
  readonly fingerprintKeys: FingerprintKeys | null
  /** Set when the Fastify instance closes: settlements still retrying in the background stop. */
  closed: boolean
}

/** Sends a problem answer; the request is then never recorded (it is not the key's outcome). */
export function answer (engine: Engine, state: RequestState | null, reply: FastifyReply, problem: ProblemAnswer): FastifyReply {
  state?.lifecycle.answered()
  return sendProblem(reply, engine.problems, engine.problemOptions, problem)
}
