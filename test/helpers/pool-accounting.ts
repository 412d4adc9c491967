/**
 * Whether a node-postgres Pool has every client back: a client the store checked out and never
 * released stays in `totalCount` but not in `idleCount`, and holds one of the pool's `max` slots
 * for good (the next checkouts would wait for it forever).
 */
import type pg from 'pg'
import { sleep } from './sleep.js'

export interface PoolCounts { readonly total: number, readonly idle: number, readonly waiting: number }

export const countsOf = (pool: pg.Pool): PoolCounts => ({ total: pool.totalCount, idle: pool.idleCount, waiting: pool.waitingCount })

/**
 * The counts once the pool has settled: a client is released just after the transaction's promise
 * settles, and a client released after a connection error is destroyed a moment later.
 */
export async function settledCounts (pool: pg.Pool, limitMs = 3000): Promise<PoolCounts> {
  const deadline = Date.now() + limitMs
  while (Date.now() < deadline && (pool.idleCount !== pool.totalCount || pool.waitingCount !== 0)) {
    await sleep(10)
  }
  return countsOf(pool)
}

/**
 * Checks out all `max` clients at once and gives them back: true when none was missing (a leaked
 * client would make the last checkout wait until `limitMs`).
 */
export async function everySlotFree (pool: pg.Pool, max: number, limitMs = 3000): Promise<boolean> {
  const clients: pg.PoolClient[] = []
  let timer: NodeJS.Timeout | undefined
  const timedOut = new Promise<false>((resolve) => { timer = setTimeout(() => resolve(false), limitMs) })
  const all = Promise.all(Array.from({ length: max }, async () => {
    const client = await pool.connect()
    clients.push(client)
  })).then(() => true as const)
  const outcome = await Promise.race([all, timedOut])
  clearTimeout(timer)
  // Checkouts still waiting get their client later: give those back as they arrive.
  void all.then(() => { for (const client of clients.splice(0)) client.release() }, () => {})
  for (const client of clients.splice(0)) client.release()
  return outcome
}
