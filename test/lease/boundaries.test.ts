import t from 'tap'
import { memoryStore } from '../../lib/index.js'
import { boundaryScenarios } from '../helpers/boundary-scenarios.js'

// The lease boundaries on the memory store, in real time; the same scenarios run on Postgres
// in test/postgres/boundaries.test.ts.
boundaryScenarios(t, { store: async () => memoryStore({ purgeInterval: 0 }) })
