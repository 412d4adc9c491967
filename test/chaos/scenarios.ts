import type { AttemptOutcome, Operation } from './history.js'
import type { Departure } from './http.js'
import type { AppInstance } from './instances.js'
import type { Random } from './random.js'
import { SHORT_TTL_MS, type Scenario, type ScenarioParameters } from './scenario-routes.js'
import { sleep } from '../helpers/sleep.js'

/**
 * The clients of the lease-boundary scenarios (scenario-routes.ts lists them): each operation
 * drives one situation to its boundary (a duplicate that arrives once the lease or the ttl is over,
 * a client that leaves and retries at once, a force release or a partition between two steps),
 * then retries as any client would until it has its answer.
 */

/** What a scenario needs from the workload. */
export interface ScenarioClient {
  readonly instances: readonly AppInstance[]
  readonly jitter: Random
  /** One attempt; a 2xx marks the operation answered. */
  attempt (op: Operation, options: { instance?: AppInstance, departure?: Departure }): Promise<AttemptOutcome>
  /**
   * Attempts until the operation is answered, at most `maxAttempts` (Infinity: until `untilMs`),
   * avoiding `avoid` when another instance runs. Impatient clients retry every 150–300 ms whatever
   * Retry-After says; the others back off as the workload's clients do.
   */
  untilAnswered (op: Operation, options: { avoid?: AppInstance, impatient?: boolean, maxAttempts?: number }): Promise<void>
  /** Until the key's in-progress record holds step `name` (the operator's view), at most `timeoutMs`. */
  untilStepRecorded (op: Operation, name: string, timeoutMs: number): Promise<boolean>
  /** The operator's force release of the operation's key (store.forceRelease), recorded as an intervention. */
  forceRelease (op: Operation): Promise<void>
  /** Locks the records table for `holdMs` if it can be taken (a few tries; true), recorded as an intervention. */
  lockRecordsTable (op: Operation, holdMs: number): Promise<boolean>
  /** Cuts `instance` from the database for `ms`, recorded as an intervention. */
  partition (instance: AppInstance, op: Operation, ms: number): Promise<void>
  /** Terminates `instance`'s settlement listener connection, recorded as an intervention. */
  killListener (instance: AppInstance, op: Operation): Promise<void>
}

/** The handler's timings for one operation of `scenario`, drawn from the seeded sequence. */
export function scenarioParameters (scenario: Scenario, draw: Random): ScenarioParameters {
  switch (scenario) {
    case 'slow': return { delayMs: draw.int(500, 1_500) }
    case 'slow-ttl': return { delayMs: draw.int(1_500, 2_000) }
    case 'abandon': return { delayMs: draw.int(1_000, 1_500) }
    case 'stream': return { chunks: 10, chunkBytes: 1_024, intervalMs: 100 }
    // 512 KiB in 8 KiB parts, 500 ms when read at once: a reader that stops holds it up.
    case 'stream-paused': return { chunks: 64, chunkBytes: 8_192, intervalMs: 8 }
    case 'steps-force':
    case 'steps-partition': return { pauseMs: 1_200 }
    case 'held': return {}
    case 'atomic-duplicate': return { delayMs: draw.int(300, 500) }
    case 'wait-lease':
    case 'wait-atomic': return { delayMs: draw.int(600, 900) }
  }
}

/** wait-lease and wait-atomic operations so far: three in four kill a listener while their duplicates wait. */
let waitAcrossRuns = 0

/** Runs one operation of `scenario` to its answer (or until the client gives up; the drain retries it). */
export async function runScenario (scenario: Scenario, op: Operation, client: ScenarioClient): Promise<void> {
  const running = client.instances.filter((instance) => instance.running)
  const first = client.jitter.pick(running.length > 0 ? running : client.instances)
  const jitter = (min: number, max: number): number => min + Math.floor(client.jitter() * (max - min + 1))
  switch (scenario) {
    case 'slow':
    case 'slow-ttl':
    case 'stream': {
      // A duplicate past the lease (slow, stream: mid-handler, mid-stream) or past the ttl (slow-ttl).
      const late = scenario === 'slow-ttl' ? jitter(SHORT_TTL_MS + 150, SHORT_TTL_MS + 400) : jitter(450, 700)
      await Promise.all([
        client.attempt(op, { instance: first }),
        sleep(late).then(() => client.untilAnswered(op, { avoid: first }))
      ])
      break
    }
    case 'abandon':
      // Leaves while the handler runs, then retries at once and again and again.
      await client.attempt(op, { instance: first, departure: { abortAfterMs: jitter(100, 250) } })
      await client.untilAnswered(op, { avoid: first, impatient: true, maxAttempts: 15 })
      break
    case 'stream-paused':
      // Stops reading the body, and a duplicate arrives meanwhile; then leaves and retries at once.
      await Promise.all([
        client.attempt(op, { instance: first, departure: { pauseThenLeaveMs: jitter(700, 1_200) } })
          .then(() => client.untilAnswered(op, { avoid: first, impatient: true, maxAttempts: 10 })),
        sleep(jitter(400, 600)).then(() => client.untilAnswered(op, { avoid: first, maxAttempts: 1 }))
      ])
      break
    case 'steps-force': {
      // Between the two steps (once the first is recorded), the operator force-releases the key.
      const owner = await firstStepRecorded(op, client, first)
      await Promise.all([
        owner?.attempt,
        (async () => {
          if (owner !== null) {
            await sleep(jitter(50, 200))
            await client.forceRelease(op)
          }
          await client.untilAnswered(op, { avoid: first })
        })()
      ])
      break
    }
    case 'steps-partition': {
      // Between the two steps, the owner's instance is cut from the database beyond its lease, and
      // a retry on another instance takes the key over; the old owner's second step comes after.
      const owner = await firstStepRecorded(op, client, first)
      if (owner === null) break
      await Promise.all([
        owner.attempt,
        client.partition(first, op, 650),
        sleep(jitter(420, 480)).then(() => client.untilAnswered(op, { avoid: first }))
      ])
      break
    }
    case 'held':
      // The first attempt fails (500) and holds the key; retries get 409 until the reconciler completes it.
      await client.attempt(op, { instance: first })
      break
    case 'wait-lease':
    case 'wait-atomic': {
      // The original on an instance with the pre-filter; 150–300 ms in, two duplicates on the
      // instance without one (they reach the store, and wait for its settlement notice) and one on
      // the third (it waits on the pre-filter's marker). In three operations of four, the listener of
      // the instance without a pre-filter is killed 100–200 ms after its duplicates began to wait:
      // they read their record at once, poll, and the listener comes back.
      const storeOnly = running.find((instance) => instance.storeOnly)
      const withPrefilter = running.filter((instance) => !instance.storeOnly)
      if (storeOnly === undefined || withPrefilter.length === 0) break
      const origin = client.jitter.pick(withPrefilter)
      const other = withPrefilter.find((instance) => instance !== origin) ?? storeOnly
      const kill = waitAcrossRuns++ % 4 !== 0
      const late = jitter(150, 300)
      await Promise.all([
        client.attempt(op, { instance: origin }),
        sleep(late).then(() => Promise.all([
          client.attempt(op, { instance: storeOnly }),
          client.attempt(op, { instance: storeOnly }),
          client.attempt(op, { instance: other }),
          kill ? sleep(jitter(100, 200)).then(() => client.killListener(storeOnly, op)) : undefined
        ]))
      ])
      break
    }
    case 'atomic-duplicate': {
      // First a lock that is not a duplicate's: the records table locked for 20–50 ms, as a busy
      // table's extension lock or a short DDL would be. The original's claim waits for it (no
      // transaction holds the key's lock), and runs. The original then holds its transaction
      // 300–500 ms on the instance without a pre-filter, so that every duplicate reaches the store:
      // one on the same instance, 60–120 ms in, and one on another instance, 200–420 ms in; each
      // finds the key's lock taken (409 at once), or came after the commit (the replay).
      const holder = running.find((instance) => instance.storeOnly)
      const elsewhere = running.filter((instance) => !instance.storeOnly)
      if (holder === undefined || elsewhere.length === 0) break
      const holdMs = jitter(20, 50)
      const locked = await client.lockRecordsTable(op, holdMs)
      const lockedFor = locked ? holdMs : 0
      await Promise.all([
        client.attempt(op, { instance: holder }),
        sleep(lockedFor + jitter(60, 120)).then(() => client.attempt(op, { instance: holder })),
        sleep(lockedFor + jitter(200, 420)).then(() => client.attempt(op, { instance: client.jitter.pick(elsewhere) }))
      ])
      break
    }
  }
  await client.untilAnswered(op, {})
}

/** Attempts of a steps scenario's first owner: one, and two more if faults stop the first ones early. */
const OWNER_ATTEMPTS = 3

/**
 * The steps scenarios' first owner: an attempt on `first`, still running, with its first step
 * recorded (the operator's view), which is where the scenario intervenes; null if there was none.
 * (Wrapped: an async function that returned the attempt itself would wait for it to end.) An attempt
 * that a fault stopped before that step (a 503 from a store cut off, a reset, a timeout) leaves
 * nothing to intervene in, and a quick run has about a dozen of these operations to cross its
 * boundaries with: so the client tries again, as any client would after a 5xx or a dropped
 * connection, while `first` runs and no answer other than a 5xx came.
 */
async function firstStepRecorded (op: Operation, client: ScenarioClient, first: AppInstance): Promise<{ attempt: Promise<AttemptOutcome> } | null> {
  for (let tries = 0; tries < OWNER_ATTEMPTS && first.running; tries++) {
    const attempt = client.attempt(op, { instance: first })
    if (await client.untilStepRecorded(op, 'reserve', 2_500)) return { attempt }
    const outcome = await attempt
    if (outcome.kind === 'response' && outcome.status < 500) return null
  }
  return null
}
