// The runner's list of failed tests (scripts/tap-failures.mjs) is what a CI log's tail shows:
// it must name each failed leaf once, and nothing that passed, was skipped or is a TODO.
import t from 'tap'
// @ts-expect-error: a plain .mjs script without declarations
import { tapFailures } from '../../scripts/tap-failures.mjs'

const stream = `TAP version 14
# Subtest: test/a.test.ts
    # Subtest: group
        ok 1 - fine
        not ok 2 - bad one # time=3ms
          ---
          at:
            line: 3
          ...
        not ok 3 - later # TODO not yet
        not ok 4 - skipped # SKIP no server
        1..4
    not ok 1 - group # time=5ms
    not ok 2 - direct
    ok 3 - other
    1..3
not ok 1 - test/a.test.ts # time=1s
# Subtest: test/b.test.ts
not ok 2 - test/b.test.ts
ok 3 - test/c.test.ts
`

t.test('names each failed leaf by its path, once', async (t) => {
  const whole = tapFailures()
  whole.write(stream)
  t.same(whole.end(), ['test/a.test.ts > group > bad one', 'test/a.test.ts > direct', 'test/b.test.ts'])
})

t.test('a stream split anywhere gives the same list', async (t) => {
  for (const size of [1, 7, 64]) {
    const split = tapFailures()
    for (let i = 0; i < stream.length; i += size) split.write(stream.slice(i, i + size))
    t.same(split.end(), ['test/a.test.ts > group > bad one', 'test/a.test.ts > direct', 'test/b.test.ts'], `chunks of ${size}`)
  }
})

t.test('a passing stream names nothing', async (t) => {
  const ok = tapFailures()
  ok.write('# Subtest: test/c.test.ts\n    ok 1 - fine\n    1..1\nok 1 - test/c.test.ts\n')
  t.same(ok.end(), [])
})
