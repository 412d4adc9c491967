import { listenerName, type ListenHandlers, type Listening } from './client.js'

/** The parts of a node-postgres `Client` the listening connection uses. */
export interface NodePostgresListenClient {
  connect (): Promise<unknown>
  query (text: string): Promise<unknown>
  end (): Promise<void>
  on (event: 'notification', listener: (message: { channel: string, payload?: string }) => void): unknown
  on (event: 'error' | 'end', listener: (err?: Error) => void): unknown
}

/** A pool's `Client` class and settings: pg-pool keeps both on the pool (`pool.Client`, `pool.options`). */
export interface NodePostgresClientSource {
  readonly Client?: new (options: Record<string, unknown>) => NodePostgresListenClient
  readonly options?: Readonly<Record<string, unknown>>
}

/**
 * The listening connection on node-postgres: a `Client` of the pool's own class with the pool's
 * settings, outside the pool, so it takes none of the application's connections. Null when the
 * pool-like object has no `Client`.
 */
export function listenOnNodePostgres (pool: NodePostgresClientSource, channel: string, handlers: ListenHandlers): Promise<Listening> | null {
  const Client = pool.Client
  if (typeof Client !== 'function') return null
  return (async () => {
    const client = new Client({ ...pool.options, application_name: listenerName(pool.options?.application_name) })
    let ended = false
    const lose = (err?: Error): void => {
      if (ended) return
      ended = true
      handlers.lost(err ?? new Error('fastify-idempotency: the settlement listener\'s connection ended'))
      client.end().catch(() => {})
    }
    // Listened to before connect(): an EventEmitter's 'error' without a listener would end the process.
    client.on('error', lose)
    client.on('end', lose)
    client.on('notification', (message) => {
      if (!ended && message.channel === channel.slice(1, -1).replaceAll('""', '"')) handlers.notice(message.payload ?? '')
    })
    try {
      await client.connect()
      await client.query(`LISTEN ${channel}`)
    } catch (err) {
      ended = true
      await client.end().catch(() => {})
      throw err
    }
    return {
      async close () {
        ended = true
        await client.end().catch(() => {})
      }
    }
  })()
}
