import FakeTimers from '@sinonjs/fake-timers'

/**
 * The simulation's virtual clock. Installed before Fastify and the plugin are loaded, so every
 * timer they set (lease renewals, store call deadlines, Fastify's handlerTimeout, the background
 * retries of a record) and every reading of the time (Date, performance.now) is virtual, and so is
 * every event of the simulation (a store call reaching the store, its answer, a handler's work, a
 * client leaving): one ordered timeline, advanced one timer at a time. setImmediate, nextTick and
 * promises stay real, so the code between two timers runs as it would.
 */
export const clock = FakeTimers.install({
  now: 1_700_000_000_000,
  toFake: ['setTimeout', 'clearTimeout', 'setInterval', 'clearInterval', 'Date', 'performance']
})

/** The virtual time, in ms since the clock was installed. */
export function now (): number {
  return clock.now - 1_700_000_000_000
}

let activity = 0

/** Something happened that may have scheduled more work (a store call, a handler step). */
export function touch (): void {
  activity++
}

const immediate = (): Promise<void> => new Promise((resolve) => { setImmediate(resolve) })

/**
 * Lets the code run until it waits on a timer: rounds of setImmediate (each drains the microtask
 * and nextTick queues) until three rounds in a row change nothing. Deterministic: the same events
 * in the same order make the same rounds.
 */
export async function settle (): Promise<void> {
  let quiet = 0
  let seen = -1
  for (let round = 0; round < 200 && quiet < 3; round++) {
    await immediate()
    const state = activity * 1_000_003 + clock.countTimers()
    if (state === seen) quiet++
    else quiet = 0
    seen = state
  }
}
