// tap's coverage map (.taprc `coverage-map`): whichever test file runs, coverage is recorded for
// the package's own code only, so the report and its thresholds are about lib/, drivers/ and
// client/, not about the tests, their helpers and fixtures, the examples or the benchmarks.
// Child processes a test spawns (fixture servers run through `node --import tsx`) inherit this
// through tap's process hooks, so what they run counts too.

export const COVERED = ['lib/**/*.ts', 'drivers/**/*.ts', 'client/**/*.ts']

export default function coverageMap () {
  return COVERED
}
