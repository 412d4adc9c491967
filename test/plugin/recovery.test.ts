import t from 'tap'
import { memoryStore } from '../../lib/index.js'
import { manualClock } from '../helpers/app.js'
import { recoveryScenarios } from '../helpers/recovery-scenarios.js'

// Recovery points, indeterminate failures, the reconciler and the operator tools on the memory
// store; the same scenarios run on Postgres in test/postgres/recovery.test.ts. The clock is
// moved by hand: leases lapse without waiting (renewal timers run every lease/3 of real time, far
// longer than a test).
const clock = manualClock(Date.now())

recoveryScenarios(t, {
  store: async () => memoryStore({ purgeInterval: 0, now: clock.now }),
  lease: 60_000,
  lapse: async (ms) => { clock.advance(ms) }
})
