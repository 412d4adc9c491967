import { appendFileSync } from 'node:fs'
import { readFile } from 'node:fs/promises'
import type { IdempotencyStore, Lease } from '../../lib/core/store.js'

/**
 * Evidence of execution that no downstream idempotency key can hide. Each app instance (and the
 * reconciler worker) appends one JSON line per event to a file of its own, synchronously: a line
 * written before a SIGKILL is on disk, and an event is logged before anything can depend on it.
 *
 * What is logged: every store call the plugin makes that decides ownership (claim, renew,
 * complete, release, hold, loadSteps, saveStep), with its start, end and result; each execution of
 * a handler (start, end, how it ended); each step `fn` actually run, and each step refused with
 * LeaseLostError; a client disconnect seen by the handler; a streamed body's start and end; the
 * reconciler's decisions; an atomic claim whose lock wait timed out. The checker (executions.ts)
 * rebuilds the executions of every key from it.
 *
 * Times are wall-clock milliseconds from `performance.timeOrigin + performance.now()`, which the
 * clock-skew preload does not move (it replaces Date only), so every process's lines share the
 * harness's clock.
 */

/** Where a line comes from: an app instance (with its process id, one per incarnation) or the reconciler. */
interface Origin {
  readonly t: number
  readonly pid: number
  /** The app instance's index; -1 for the reconciler worker. */
  readonly instance: number
}

/** A store call of the plugin, as the instance's store wrapper saw it. `ok` is null when the call threw. */
export type StoreCallLine = Origin & {
  readonly ev: 'renew' | 'complete' | 'release' | 'hold' | 'loadSteps' | 'saveStep'
  readonly end: number
  readonly scope: string
  readonly key: string
  readonly token: string
  readonly ok: boolean | null
}

export type ClaimLine = Origin & {
  readonly ev: 'claim'
  readonly end: number
  readonly scope: string
  readonly key: string
  /** `error` when the call threw (a timeout, an outage). */
  readonly outcome: 'acquired' | 'in_progress' | 'completed' | 'error'
  readonly takeover: boolean
  readonly token: string | null
  /** Atomic mode: the claim holds an open transaction (no lease to renew). */
  readonly transactional: boolean
}

/** One execution of a handler: a request that owns its key (request.idempotency set, not a replay). */
export type ExecStartLine = Origin & {
  readonly ev: 'exec-start'
  readonly req: string
  readonly scope: string
  readonly key: string
  readonly route: string
  readonly leaseMs: number
  readonly ttlMs: number
}

export type RequestLine = Origin & (
  | { readonly ev: 'exec-end', readonly req: string, readonly how: 'returned' | 'threw', readonly error?: string }
  /** The client went away (its response closed before it finished) while this request owned the key. */
  | { readonly ev: 'client-gone', readonly req: string }
  | { readonly ev: 'response-close', readonly req: string, readonly finished: boolean }
  | { readonly ev: 'stream-start', readonly req: string }
  | { readonly ev: 'stream-end', readonly req: string, readonly how: 'end' | 'destroyed' }
  /** The handler called step(name); `step-run`: the step's fn started; `step-refused`: it threw LeaseLostError. */
  | { readonly ev: 'step-call' | 'step-run' | 'step-done', readonly req: string, readonly name: string }
  | { readonly ev: 'step-refused', readonly req: string, readonly name: string, readonly error: string }
  | { readonly ev: 'mark-indeterminate', readonly req: string }
)

/** The reconciler worker's decision for a stuck record (logged before the store applies it). */
export type ResolveLine = Origin & {
  readonly ev: 'resolve'
  readonly scope: string
  readonly key: string
  readonly action: 'complete' | 'release' | 'resume' | 'leave'
}

/** The process's event loop did not run from `t` to `end` (a timer fired that much late): it could renew nothing. */
export type StallLine = Origin & { readonly ev: 'stall', readonly end: number }

/** What a planted bug did at the store behind the plugin's back (for the key's history). */
export type PlantLine = Origin & { readonly ev: 'plant', readonly scope: string, readonly key: string, readonly what: string }

export type EvidenceLine = StoreCallLine | ClaimLine | ExecStartLine | RequestLine | ResolveLine | PlantLine | StallLine

export type EvidenceEvent = EvidenceLine extends infer L ? L extends EvidenceLine ? Omit<L, 't' | 'pid' | 'instance'> : never : never

/** Wall-clock ms that the clock-skew preload does not move. */
export function realNow (): number {
  return performance.timeOrigin + performance.now()
}

export interface EvidenceLog {
  (event: EvidenceEvent, at?: number): void
}

/** An appender for one process: every line carries its pid and instance index. */
export function evidenceLog (file: string, instance: number): EvidenceLog {
  return (event, at = realNow()) => {
    appendFileSync(file, JSON.stringify({ t: Math.round(at), pid: process.pid, instance, ...event }) + '\n')
  }
}

/**
 * Logs every stretch longer than `thresholdMs` in which the process's event loop did not run (a
 * CPU-starved or paused process): such an owner cannot renew, as if it were cut off.
 */
export function watchStalls (log: EvidenceLog, thresholdMs = 200, everyMs = 50): void {
  let last = realNow()
  setInterval(() => {
    const now = realNow()
    if (now - last > thresholdMs) log({ ev: 'stall', end: Math.round(now) }, last)
    last = now
  }, everyMs).unref()
}

/** Every line of the files, times made relative to the harness's `t0` (epoch ms), in time order. */
export async function readEvidence (files: readonly string[], t0: number): Promise<EvidenceLine[]> {
  const lines: EvidenceLine[] = []
  for (const file of files) {
    const text = await readFile(file, 'utf8').catch((err: NodeJS.ErrnoException) => { if (err.code === 'ENOENT') return ''; throw err })
    for (const raw of text.split('\n')) {
      // A process killed mid-write can leave a torn last line: it is no evidence of anything.
      if (raw === '') continue
      let line: EvidenceLine
      try {
        line = JSON.parse(raw) as EvidenceLine
      } catch {
        continue
      }
      const shifted = { ...line, t: line.t - t0 } as EvidenceLine
      if ('end' in shifted) (shifted as { end: number }).end = shifted.end - t0
      lines.push(shifted)
    }
  }
  return lines.sort((a, b) => a.t - b.t)
}

type StoreMethod = 'claim' | 'claimInTransaction' | 'renew' | 'complete' | 'release' | 'hold' | 'loadSteps' | 'saveStep'

/**
 * The store as the plugin sees it, with every ownership decision logged (what the store did, not
 * what the plugin meant to do). A Proxy: any other method or property (including ones a later
 * plugin version may use) reaches the real store unchanged, and an optional method the store lacks
 * stays absent.
 */
export function loggedStore<S extends IdempotencyStore> (store: S, log: EvidenceLog): S {
  const timed = async <T>(fn: () => T | Promise<T>, record: (result: T | null, threw: boolean, start: number) => void): Promise<T> => {
    const start = realNow()
    let result: T
    try {
      result = await fn()
    } catch (err) {
      record(null, true, start)
      throw err
    }
    record(result, false, start)
    return result
  }
  const claim = (method: 'claim' | 'claimInTransaction', transactional: boolean) => (request: Parameters<IdempotencyStore['claim']>[0], ...rest: unknown[]) =>
    timed(() => (store[method] as (...args: unknown[]) => ReturnType<IdempotencyStore['claim']>).call(store, request, ...rest), (result, threw, start) => {
      log({
        ev: 'claim',
        end: Math.round(realNow()),
        scope: request.scope,
        key: request.key,
        outcome: threw || result === null ? 'error' : result.outcome,
        takeover: result?.outcome === 'acquired' && result.takeover,
        token: result?.outcome === 'acquired' ? result.lease.token : null,
        transactional
      }, start)
    })
  const fenced = (method: Exclude<StoreMethod, 'claim' | 'claimInTransaction'>) => (lease: Lease, ...rest: unknown[]) =>
    timed(() => (store[method] as (...args: unknown[]) => Promise<unknown>).call(store, lease, ...rest), (result, threw, start) => {
      const ok = threw ? null : method === 'loadSteps' ? result !== null : result === true
      log({ ev: method, end: Math.round(realNow()), scope: lease.scope, key: lease.key, token: lease.token, ok }, start)
    })
  const overrides: Partial<Record<StoreMethod, unknown>> = {
    claim: claim('claim', false),
    claimInTransaction: claim('claimInTransaction', true),
    renew: fenced('renew'),
    complete: fenced('complete'),
    release: fenced('release'),
    hold: fenced('hold'),
    loadSteps: fenced('loadSteps'),
    saveStep: fenced('saveStep')
  }
  return new Proxy(store, {
    get (target, property, receiver) {
      const value = Reflect.get(target, property, receiver) as unknown
      if (typeof value !== 'function') return value
      if (Object.hasOwn(overrides, property)) return overrides[property as StoreMethod]
      return (value as (...args: unknown[]) => unknown).bind(target)
    }
  })
}
