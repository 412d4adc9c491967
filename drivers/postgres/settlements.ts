import { createHash } from 'node:crypto'
import type { RecordId, SettlementHandlers } from '../../lib/core/store.js'
import { settlementDigest } from '../../lib/core/waiters.js'
import type { DatabaseClient, Listening } from './client.js'

/*
 * Settlement notices on PostgreSQL: LISTEN/NOTIFY on one channel per records table. A settlement
 * that someone may wait for (a claim made with `announce`) sends `pg_notify(channel, digest)`
 * after it; each store that watches keeps ONE connection of its own listening (not one per
 * waiter, and none of the pool's), and wakes its waiters from it.
 *
 * Why only announced settlements: a transaction that has sent a notice serializes its commit with
 * every other such transaction on the server (PostgreSQL takes one lock for the notification
 * queue from its pre-commit until the commit is flushed), so a notice on every settlement would
 * make every request's commit wait its turn. A route that does not wait sends none.
 *
 * A notice is sent by the statement after the settlement, not inside it: on Citus, NOTIFY reaches
 * the listeners of the node it runs on, and a plain `SELECT pg_notify(...)` runs on the
 * coordinator, where every listener is connected. A process that dies between the settlement and
 * its notice leaves waiters to notice the settlement by themselves: when the original's lease
 * lapses, or when their wait ends.
 */

const NOTIFY_TEXT = 'SELECT pg_notify($1, $2)'

/** First and longest pause before listening again after the listener was lost or could not connect. */
const FIRST_RETRY_MS = 100
const MAX_RETRY_MS = 5_000

/** The channel of a records table: a plain identifier (at most 63 bytes), the same in every process. */
export function settlementChannel (schema: string, table: string): string {
  const digest = createHash('sha256').update(`${schema.length}:${schema}${table}`).digest('hex').slice(0, 24)
  return `fastify_idempotency_${digest}`
}

/** Sends the notice of `id`'s settlement; resolves when it was sent (a failure is the caller's to report). */
export async function announceSettlement (db: DatabaseClient, channel: string, id: RecordId): Promise<void> {
  await db.query(NOTIFY_TEXT, [channel, settlementDigest(id.scope, id.key)])
}

/**
 * The watch: listens on `channel`, and listens again after a loss, pausing 100 ms doubling to 5 s
 * while it cannot. Every loss and every failed attempt goes to `report`. Returns the function that
 * stops it. When the client cannot open a connection of its own, the watch never goes live and
 * waiters poll.
 */
export function watchChannel (db: DatabaseClient, channel: string, handlers: SettlementHandlers, report: (err: unknown) => void): () => void {
  let stopped = false
  let listening: Listening | null = null
  let timer: NodeJS.Timeout | null = null
  let pause = FIRST_RETRY_MS

  const again = (): void => {
    if (stopped) return
    timer = setTimeout(() => { timer = null; listen() }, pause)
    timer.unref()
    pause = Math.min(pause * 2, MAX_RETRY_MS)
  }

  function listen (): void {
    let lost = false
    const opened = db.listen(`"${channel}"`, {
      notice: (payload) => { handlers.settled(payload) },
      lost: (err) => {
        lost = true
        listening = null
        if (stopped) return
        handlers.live(false)
        report(err)
        again()
      }
    })
    if (opened === null) return
    opened.then((connection) => {
      if (stopped) {
        connection.close().catch(() => {})
        return
      }
      // Lost between the LISTEN and here: already reported, and already retrying.
      if (lost) return
      listening = connection
      pause = FIRST_RETRY_MS
      handlers.live(true)
    }, (err: unknown) => {
      if (stopped || lost) return
      report(err)
      again()
    })
  }

  listen()
  return () => {
    stopped = true
    if (timer !== null) clearTimeout(timer)
    listening?.close().catch(() => {})
    listening = null
  }
}
