/**
 * How `npm run bench` (run.ts) drives its servers with autocannon, shared with the harnesses that
 * set it beside wrk (crosscheck.ts --same-window, generators.ts), so that "autocannon's figure"
 * means one thing wherever it is measured: a POST /pay with the benchmark's JSON body, its
 * Idempotency-Key set per request.
 */
import autocannon from 'autocannon'
import { BODY } from './route.js'

/** A request whose idempotency-key header `key()` picks anew each time autocannon sends it. */
export function keyed (key: () => string): autocannon.Request[] {
  return [{
    method: 'POST',
    path: '/pay',
    setupRequest (request) {
      (request.headers ??= {})['idempotency-key'] = key()
      return request
    }
  }]
}

/** A load of `seconds`, or of exactly `amount` requests (autocannon: amount overrides duration). */
export function autocannonLoad (url: string, requests: autocannon.Request[], seconds: number, connections: number, amount?: number): Promise<autocannon.Result> {
  return autocannon({
    url,
    connections,
    duration: seconds,
    ...(amount === undefined ? {} : { amount }),
    // The stop is checked at each sample; the default (1 s) would stretch a 1.5 s run to 2 s.
    sampleInt: 100,
    headers: { 'content-type': 'application/json' },
    body: BODY,
    requests
  })
}
