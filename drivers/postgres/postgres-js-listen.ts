import type { Sql } from 'postgres'
import { listenerName, type ListenHandlers, type Listening } from './client.js'

/**
 * The listening connection on postgres.js: a client of its own with one connection, made from the
 * application's client's settings (`sql.options`, as postgres.js's own `sql.listen` makes its
 * listener). Not `sql.listen` itself: when its connection drops, it listens again in the
 * background and drops a failure silently, so a listener lost while the database was down would
 * stay lost with nothing to tell; here every loss is reported and the caller decides when to
 * listen again (settlements.ts).
 */
export async function listenOnPostgresJs (sql: Sql<any>, channel: string, handlers: ListenHandlers): Promise<Listening> {
  // Loaded here: an application on node-postgres need not have postgres.js installed.
  const postgres = (await import('postgres')).default as unknown as (options: Record<string, unknown>) => Sql<any>
  const options = (sql as unknown as { options: Record<string, unknown> }).options
  const connection = options.connection as Record<string, unknown> | undefined
  let ended = false
  const lose = (err: Error): void => {
    if (ended) return
    ended = true
    handlers.lost(err)
    listener.end({ timeout: 0 }).catch(() => {})
  }
  const listener = postgres({
    ...options,
    max: 1,
    idle_timeout: null,
    max_lifetime: null,
    fetch_types: false,
    connection: { ...connection, application_name: listenerName(connection?.application_name) },
    onnotify (name: string, payload: string) {
      if (!ended && name === channel.slice(1, -1).replaceAll('""', '"')) handlers.notice(payload)
    },
    onclose () { lose(new Error('fastify-idempotency: the settlement listener\'s connection closed')) }
  })
  try {
    await listener.unsafe(`LISTEN ${channel}`)
  } catch (err) {
    ended = true
    await listener.end({ timeout: 0 }).catch(() => {})
    throw err
  }
  return {
    async close () {
      ended = true
      await listener.end({ timeout: 0 }).catch(() => {})
    }
  }
}
