// Collects the failed tests from a TAP stream (tap's `--reporter=tap`), each named by its
// path: `test/file.test.ts > subtest > assertion`. The runner prints them just before its
// summary line, and .ci/run repeats them at the very end, so the tail of a CI log names what
// failed on every Node line instead of only how many.

const INDENT = 4 // tap indents each subtest level by four spaces

export function tapFailures () {
  let partial = ''
  const names = [] // names[depth]: the subtest open at that depth
  const failures = [] // paths, deepest first (a parent's `not ok` follows its children's)

  function line (text) {
    const depth = Math.floor((text.length - text.trimStart().length) / INDENT)
    const body = text.trim()
    const subtest = /^# Subtest: (.*)$/.exec(body)
    if (subtest) {
      names.length = depth
      names[depth] = subtest[1]
      return
    }
    const failed = /^not ok \d+(?: - (.*?))?(?: # (.*))?$/.exec(body)
    if (!failed || /^(TODO|SKIP)\b/i.test(failed[2] ?? '')) return
    const path = [...names.slice(0, depth), failed[1] ?? '(unnamed)'].join(' > ')
    // a failed parent repeats what its failed children already named
    if (!failures.some((f) => f.startsWith(path + ' > '))) failures.push(path)
  }

  return {
    write (chunk) {
      const lines = (partial + chunk).split('\n')
      partial = lines.pop()
      for (const l of lines) line(l)
    },
    end () {
      if (partial) line(partial)
      partial = ''
      return failures
    }
  }
}
