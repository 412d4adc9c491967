/**
 * Preloaded into each app instance (`node --import tsx --import ./test/chaos/clock-skew.ts`): shifts
 * the process's wall clock (Date.now() and `new Date()`) by CHAOS_CLOCK_SKEW_MS, and again whenever
 * the harness sends `{ type: 'clock-skew', ms }` over IPC. Instances then disagree about the time by
 * minutes; the Postgres store measures leases and expiry on the database clock (now()), so the
 * outcome must not change. Timers (monotonic) are unaffected, as with a real skewed host.
 */

const RealDate = Date
const realNow = RealDate.now.bind(RealDate)
let offset = Number(process.env.CHAOS_CLOCK_SKEW_MS ?? '0')

const SkewedDate = new Proxy(RealDate, {
  construct (target, args, newTarget) {
    return Reflect.construct(target, args.length === 0 ? [realNow() + offset] : args, newTarget) as object
  },
  apply () {
    return new RealDate(realNow() + offset).toString()
  },
  get (target, property, receiver) {
    if (property === 'now') return () => realNow() + offset
    return Reflect.get(target, property, receiver) as unknown
  }
})
globalThis.Date = SkewedDate

process.on('message', (message: unknown) => {
  const m = message as { type?: unknown, ms?: unknown } | null
  if (m !== null && typeof m === 'object' && m.type === 'clock-skew' && typeof m.ms === 'number') offset = m.ms
})
