/**
 * Deadlines shared by many requests. Every store call is bounded by `storeTimeout`, and every owner
 * renews its lease every `lease / 3`: one timer per call and per owner, created and cancelled on
 * every request, was a measurable part of the hot path. Items that wait the same delay become due
 * in the order they were added, so one list per delay, in that order, with one timer set for its
 * first item, serves them all: adding and removing are O(1), and no timer is created or cancelled
 * per item (at most one fires per delay).
 */

/** What a schedule holds: its place in the list, kept on the item itself. */
export interface Scheduled {
  dueAt: number
  previous: Scheduled | null
  next: Scheduled | null
  scheduled: boolean
}

export class Schedule<T extends Scheduled> {
  #first: T | null = null
  #last: T | null = null
  #timer: NodeJS.Timeout | null = null

  /**
   * `due` runs for each item whose delay has passed, after it left the schedule. `keepAlive`: the
   * timer keeps the process alive while items wait (a store call's deadline must fire even if
   * nothing else is left to do), or not (a renewal has no business holding a process up).
   */
  constructor (readonly delay: number, private readonly due: (item: T) => void, private readonly keepAlive: boolean) {}

  add (item: T): void {
    item.dueAt = performance.now() + this.delay
    item.previous = this.#last
    item.next = null
    item.scheduled = true
    if (this.#last === null) {
      this.#first = item
      if (this.#timer !== null && this.keepAlive) this.#timer.ref()
    } else {
      this.#last.next = item
    }
    this.#last = item
    if (this.#timer === null) this.#arm(this.delay)
  }

  /**
   * Takes `item` out (a no-op when it is not scheduled). The timer stays: when it fires it re-arms
   * for the next item, or, none being left, lapses. An empty schedule's timer no longer keeps the
   * process alive.
   */
  remove (item: T): void {
    if (!item.scheduled) return
    item.scheduled = false
    if (item.previous === null) this.#first = item.next as T | null
    else item.previous.next = item.next
    if (item.next === null) this.#last = item.previous as T | null
    else item.next.previous = item.previous
    item.previous = null
    item.next = null
    // Unref'd rather than cleared: with a fast store the list empties after nearly every call,
    // and clearing then re-creating the timer each time would cost what one shared timer saves.
    if (this.#first === null && this.#timer !== null && this.keepAlive) this.#timer.unref()
  }

  /** Takes every waiting item out, in order, and runs `each` on it (a closing owner settles them all at once). */
  drain (each: (item: T) => void): void {
    for (let item = this.#first; item !== null; item = this.#first) {
      this.remove(item)
      each(item)
    }
  }

  #arm (ms: number): void {
    // A delay shorter than 1 ms would be a busy loop; Node rounds it up to 1 ms anyway.
    const timer = setTimeout(fire, Math.max(1, Math.ceil(ms)), this)
    if (!this.keepAlive) timer.unref()
    this.#timer = timer
  }

  /** Runs the items that are due, then re-arms for the first one still waiting. */
  expire (): void {
    this.#timer = null
    const now = performance.now()
    for (let item = this.#first; item !== null && item.dueAt <= now; item = this.#first) {
      this.remove(item)
      this.due(item)
    }
    if (this.#first !== null) this.#arm(this.#first.dueAt - now)
  }
}

function fire (schedule: { expire: () => void }): void {
  schedule.expire()
}

/** One schedule per delay, created on first use: the delays in use are a handful of option values. */
export function schedules<T extends Scheduled> (due: (item: T) => void, keepAlive: boolean): (delay: number) => Schedule<T> {
  const byDelay = new Map<number, Schedule<T>>()
  return (delay) => {
    let schedule = byDelay.get(delay)
    if (schedule === undefined) {
      schedule = new Schedule(delay, due, keepAlive)
      byDelay.set(delay, schedule)
    }
    return schedule
  }
}
