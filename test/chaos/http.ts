import { request } from 'node:http'

/**
 * One HTTP request on a connection of its own (no keep-alive pool), so a fault on a connection
 * (a dropped reply, a reset) hits exactly one attempt, as it would a client behind a load balancer.
 */

export type HttpResult =
  | { readonly ok: true, readonly status: number, readonly headers: Readonly<Record<string, string | string[] | undefined>>, readonly body: string }
  | { readonly ok: false, readonly error: string }

/** A client that leaves on purpose (the lease-boundary scenarios). */
export interface Departure {
  /** Close the connection this long after sending, whatever has arrived: `client-abort`. */
  readonly abortAfterMs?: number
  /** Stop reading once the response head arrived, then close the connection after this long: `client-left`. */
  readonly pauseThenLeaveMs?: number
}

export function post (port: number, path: string, headers: Record<string, string>, body: string, timeoutMs: number, departure: Departure = {}): Promise<HttpResult> {
  return send('POST', port, path, headers, body, timeoutMs, departure)
}

export function get (port: number, path: string, timeoutMs: number): Promise<HttpResult> {
  return send('GET', port, path, {}, null, timeoutMs, {})
}

function send (method: string, port: number, path: string, headers: Record<string, string>, body: string | null, timeoutMs: number, departure: Departure): Promise<HttpResult> {
  return new Promise((resolve) => {
    let settled = false
    const finish = (result: HttpResult): void => {
      if (settled) return
      settled = true
      clearTimeout(timer)
      resolve(result)
    }
    const req = request({
      host: '127.0.0.1',
      port,
      path,
      method,
      agent: false,
      headers: body === null ? headers : { ...headers, 'content-length': String(Buffer.byteLength(body)) }
    }, (res) => {
      if (departure.pauseThenLeaveMs !== undefined) {
        // Nothing is read: TCP's window closes and the server's writes back up.
        res.pause()
        setTimeout(() => {
          finish({ ok: false, error: 'client-left' })
          req.destroy()
        }, departure.pauseThenLeaveMs)
        return
      }
      const chunks: Buffer[] = []
      res.on('data', (chunk: Buffer) => chunks.push(chunk))
      res.on('end', () => finish({ ok: true, status: res.statusCode ?? 0, headers: res.headers, body: Buffer.concat(chunks).toString('utf8') }))
      res.on('error', (err) => finish({ ok: false, error: errorName(err) }))
      res.on('aborted', () => finish({ ok: false, error: 'aborted' }))
    })
    const timer = setTimeout(() => {
      finish({ ok: false, error: 'timeout' })
      req.destroy()
    }, timeoutMs)
    req.on('error', (err) => finish({ ok: false, error: errorName(err) }))
    if (departure.abortAfterMs !== undefined) {
      setTimeout(() => {
        if (settled) return
        finish({ ok: false, error: 'client-abort' })
        req.destroy()
      }, departure.abortAfterMs)
    }
    req.end(body ?? undefined)
  })
}

function errorName (err: Error): string {
  const code = (err as { code?: unknown }).code
  return typeof code === 'string' ? code : err.message
}
