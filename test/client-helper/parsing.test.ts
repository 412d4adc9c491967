import t from 'tap'
import { backoffDelay, retryAfterMs } from '../../client/backoff.js'
import { parseHttpDate } from '../../client/http-date.js'
import { parseProblem } from '../../client/problem.js'

/*
 * The client's pure parts: Retry-After and HTTP-date parsing (RFC 9110 §10.2.3, §5.6.7), the
 * backoff formula, and RFC 9457 problem parsing.
 */

const JAN_2026 = (): number => Date.UTC(2026, 0, 1)
const iso = (ms: number | null): string | null => ms === null ? null : new Date(ms).toISOString()

t.test('the three HTTP-date formats are UTC, whatever the local time zone', async (t) => {
  t.equal(iso(parseHttpDate('Sun, 06 Nov 1994 08:49:37 GMT', JAN_2026)), '1994-11-06T08:49:37.000Z', 'IMF-fixdate')
  t.equal(iso(parseHttpDate('Sunday, 06-Nov-94 08:49:37 GMT', JAN_2026)), '1994-11-06T08:49:37.000Z', 'rfc850-date')
  // Date.parse reads this zoneless form as local time; the test runs in any TZ, so only a UTC reading passes everywhere.
  t.equal(iso(parseHttpDate('Sun Nov  6 08:49:37 1994', JAN_2026)), '1994-11-06T08:49:37.000Z', 'asctime-date, a space-padded day')
  t.equal(iso(parseHttpDate('Friday, 01-Jan-27 00:00:00 GMT', JAN_2026)), '2027-01-01T00:00:00.000Z', 'a two-digit year in the next 50 years stays in this century')
  t.equal(iso(parseHttpDate('Monday, 01-Jan-80 00:00:00 GMT', JAN_2026)), '1980-01-01T00:00:00.000Z', '... one further ahead is the previous century\'s')
  for (const bad of ['2024', 'soon', 'Sun, 06 Nov 1994 08:49:37', 'Sun, 06 Foo 1994 08:49:37 GMT', 'Sun, 06 Nov 1994 25:00:00 GMT', '']) {
    t.equal(parseHttpDate(bad, JAN_2026), null, `${JSON.stringify(bad)} is not an HTTP-date`)
  }
})

t.test('Retry-After: delay-seconds, or an HTTP-date measured against the response\'s Date', async (t) => {
  const after = (fields: Record<string, string>, clock = JAN_2026): number | null => retryAfterMs(new Headers(fields), clock)
  t.equal(after({ 'retry-after': '120' }), 120_000)
  t.equal(after({ 'retry-after': ' 0 ' }), 0)
  t.equal(after({ 'retry-after': 'Sun, 06 Nov 1994 08:49:47 GMT', date: 'Sun, 06 Nov 1994 08:49:37 GMT' }), 10_000, 'relative to the server\'s Date')
  t.equal(after({ 'retry-after': 'Thu, 01 Jan 2026 00:00:05 GMT' }), 5_000, 'without Date, relative to the client\'s clock')
  t.equal(after({ 'retry-after': 'Sun, 06 Nov 1994 08:49:37 GMT', date: 'Sun, 06 Nov 1994 08:50:00 GMT' }), 0, 'a date already past: no wait')
  for (const bad of ['-1', '1.5', 'soon', '']) t.equal(after({ 'retry-after': bad }), null, `${JSON.stringify(bad)} is ignored`)
  t.equal(after({}), null, 'absent')
})

t.test('backoff: exponential cap, full jitter, capped by maxMs', async (t) => {
  const at = (random: number): number[] => [1, 2, 3, 4, 5].map((retry) => backoffDelay(retry, 100, 500, () => random))
  t.same(at(0), [0, 0, 0, 0, 0], 'full jitter reaches 0')
  t.same(at(0.5), [50, 100, 200, 250, 250])
  t.same(at(0.9999), [99, 199, 399, 499, 499], 'always below the cap')
  t.equal(backoffDelay(40, 100, 8_000, () => 0.5), 4_000, 'a large retry number does not overflow past maxMs')
})

t.test('problem details: parsed only from application/problem+json; members of the wrong type are dropped', async (t) => {
  const body = (value: unknown): Uint8Array => new TextEncoder().encode(JSON.stringify(value))
  const problemJson = new Headers({ 'content-type': 'application/problem+json; charset=utf-8' })

  t.same(parseProblem(problemJson, body({ type: 'tag:x:key-reused', title: 'T', status: 422, detail: 'D', originalStatus: 201 })),
    { type: 'tag:x:key-reused', title: 'T', status: 422, detail: 'D', originalStatus: 201 }, 'standard and extension members (RFC 9457 §3.2)')
  t.same(parseProblem(problemJson, body({ title: 'no type' })), { type: 'about:blank', title: 'no type' }, 'type defaults to about:blank (§3.1.1)')
  t.same(parseProblem(problemJson, body({ type: 7, title: ['x'], status: '409', detail: null, instance: 1 })), { type: 'about:blank' },
    'wrongly typed members are ignored (§3.1)')
  t.equal(parseProblem(problemJson, new TextEncoder().encode('{not json')), null, 'malformed JSON')
  t.equal(parseProblem(problemJson, body([1, 2])), null, 'not an object')
  t.equal(parseProblem(new Headers({ 'content-type': 'application/json' }), body({ type: 'x' })), null, 'plain JSON is not a problem')
  t.equal(parseProblem(new Headers(), body({ type: 'x' })), null, 'no content type')
})
