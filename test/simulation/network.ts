import type { Random } from '../chaos/random.js'
import { now, touch } from './clock.js'
import type { Trace } from './trace.js'

/*
 * The simulated network between the instances and the store (and the pre-filter). Each call is a
 * request that reaches the store after a delay, is applied there, and is answered after another
 * delay, all on the virtual clock. What can happen to a call, drawn from the run's seed:
 *
 * - ok: applied, answered after a short delay;
 * - slow: applied, answered after a long delay (past storeTimeout, past a lease);
 * - lost: applied, never answered (the connection dropped after the server did the work);
 * - fail-before: refused before it reached the store (connection refused): nothing applied;
 * - fail-after: applied, then the connection failed before the answer (the caller sees an error).
 *
 * A renewal is always applied (ok, slow or lost, and quickly): the store contract lets a key go only
 * when its owner could not reach the store for a whole lease, so a simulation where a live owner's
 * renewals stop reaching the store would report as a double execution what the contract allows.
 */

export type Fault = 'ok' | 'slow' | 'lost' | 'fail-before' | 'fail-after'

export interface FaultRates {
  readonly slow: number
  readonly lost: number
  readonly failBefore: number
  readonly failAfter: number
}

export const CALM: FaultRates = { slow: 0, lost: 0, failBefore: 0, failAfter: 0 }

export interface CallRecord {
  readonly operation: string
  readonly key: string
  readonly request: number | null
  readonly token: string | null
  readonly fault: Fault
  /** When the answer was delivered, and what it was (`error` for a failure). */
  answer: string | null
}

/** The store's answers delivered in the current step of the simulation, for the checks. */
export interface Delivered {
  readonly operation: string
  readonly key: string
  readonly answer: string
}

/** A window of virtual time in which every call but renewals is refused (the store unreachable). */
export interface Outage {
  readonly from: number
  readonly until: number
}

export class Network {
  rates: FaultRates
  outage: Outage | null = null
  readonly calls: CallRecord[] = []
  delivered: Delivered[] = []
  /** Told of every answer delivered (run.ts counts what the run went through). */
  onDeliver: (call: CallRecord) => void = () => {}

  constructor (private readonly random: Random, rates: FaultRates, private readonly trace: Trace) {
    this.rates = rates
  }

  #fault (operation: string): Fault {
    const r = this.random()
    const { slow, lost, failBefore, failAfter } = this.rates
    const renewal = operation === 'renew' || operation === 'give-up'
    if (!renewal && this.outage !== null && now() >= this.outage.from && now() < this.outage.until) return 'fail-before'
    if (r < slow) return 'slow'
    if (r < slow + lost) return 'lost'
    if (renewal) return 'ok'
    if (r < slow + lost + failBefore) return 'fail-before'
    if (r < slow + lost + failBefore + failAfter) return 'fail-after'
    return 'ok'
  }

  /** Delay until the call reaches the store: short, so a renewal lands well within its lease. */
  #there (): number { return this.random.int(0, 8) }

  /** Delay of the answer back. */
  #back (fault: Fault): number {
    return fault === 'slow' ? this.random.int(40, 700) : this.random.int(0, 8)
  }

  /**
   * A call applied at once when it reaches the store. `refused` runs when the call fails before
   * reaching it (a transaction's connection that died: the server rolls the transaction back).
   */
  call<T> (operation: string, key: string, request: number | null, apply: () => T, describe: (value: T) => string, token: string | null = null, refused: () => void = () => {}): Promise<T> {
    return this.callDeferred(operation, key, request, (answer) => { answer(apply()) }, describe, token, refused)
  }

  /** A call whose result the store produces later (a claim waiting for a lock); `apply` learns the call's fault. */
  callDeferred<T> (operation: string, key: string, request: number | null, apply: (answer: (value: T) => void, fault: Fault) => void, describe: (value: T) => string, token: string | null = null, refused: () => void = () => {}): Promise<T> {
    const fault = this.#fault(operation)
    const record: CallRecord = { operation, key, request, token, fault, answer: null }
    this.calls.push(record)
    touch()
    const label = `${operation} ${key}${request === null ? '' : ` r${request}`}${token === null ? '' : ` ${token.slice(0, 6)}`}`
    return new Promise<T>((resolve, reject) => {
      const deliver = (answer: string, settle: () => void): void => {
        record.answer = answer
        this.delivered.push({ operation, key, answer })
        this.trace.log(`← ${label}: ${answer}`)
        touch()
        this.onDeliver(record)
        settle()
      }
      setTimeout(() => {
        touch()
        if (fault === 'fail-before') {
          this.trace.log(`✗ ${label} refused before reaching the store`)
          refused()
          setTimeout(() => { deliver('error (nothing applied)', () => reject(new Error(`sim: ${operation} refused (connection refused)`))) }, this.#back('ok'))
          return
        }
        let applied = false
        try {
          apply((value: T) => {
            if (applied) return
            applied = true
            touch()
            const answer = describe(value)
            this.trace.log(`→ ${label} applied: ${answer}${fault === 'ok' ? '' : ` [${fault}]`}`)
            if (fault === 'lost') return
            setTimeout(() => {
              if (fault === 'fail-after') deliver(`error (applied: ${answer})`, () => reject(new Error(`sim: ${operation} connection reset after it was applied`)))
              else deliver(answer, () => resolve(value))
            }, this.#back(fault))
          }, fault)
        } catch (err) {
          this.trace.log(`→ ${label} failed on the store: ${(err as Error).message}`)
          setTimeout(() => { deliver('error', () => reject(err)) }, this.#back('ok'))
        }
      }, this.#there())
    })
  }

  /** The delivered answers of one step, taken. */
  takeDelivered (): Delivered[] {
    const delivered = this.delivered
    this.delivered = []
    return delivered
  }

  /** Calls of `operation` made for `token` that failed from the caller's point of view. */
  failuresOf (operation: string, token: string): number {
    return this.calls.filter((call) => call.operation === operation && call.token === token && call.fault !== 'ok').length
  }

  at (): number { return now() }
}
