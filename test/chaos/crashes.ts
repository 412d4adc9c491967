import type { Crash } from './history.js'

/**
 * Processes of the harness that died without being killed by it. A crash is a finding: unless its
 * cause is a known defect outside the plugin, the checker reports it as a violation; and any crash,
 * known cause or not, fails the run (deaths.ts: the target is 0 process deaths on either client).
 */

const KNOWN_CAUSES: ReadonlyArray<{ readonly pattern: RegExp, readonly cause: string }> = [
  {
    // postgres.js 3.4.9 writes to a connection whose socket already closed, from a setImmediate,
    // so no caller can catch it: a reserved or transaction connection whose backend died takes
    // the process down (porsager/postgres#1208, #1154; unreleased fixes #1209, #1176).
    pattern: /reading 'write'\)[\s\S]*at Immediate\.nextWrite \(.*postgres\/src\/connection\.js/,
    cause: 'postgres.js 3.4.9: nextWrite() on a closed socket (porsager/postgres#1208)'
  }
]

export function crashOf (process: string, at: number, code: number | null, signal: string | null, stderrTail: string): Crash {
  const known = KNOWN_CAUSES.find((candidate) => candidate.pattern.test(stderrTail))
  const lines = stderrTail.trimEnd().split('\n')
  // From the fatal error on, when there is one: Node may follow it with pages of the error's
  // properties (node-postgres's errors carry their client), which say nothing of the cause.
  const fatal = lastIndexOf(lines, isErrorLine)
  const shown = fatal === -1 ? lines.slice(-12) : lines.slice(Math.max(0, fatal - 4), fatal + 8)
  return { process, at, exit: signal ?? String(code), knownCause: known?.cause ?? null, stderr: shown.join('\n'), error: fatalError(stderrTail) }
}

/**
 * The unindented line Node starts an uncaught error with (`TypeError: …`, `Error: …`,
 * `<ref *1> Error: …` for an error that refers to itself, `error: …` for node-postgres's
 * DatabaseError, whose name is "error"); its stack lines are indented.
 */
const isErrorLine = (line: string): boolean => /^(?:<ref \*\d+> )?(?:Uncaught )?(?:[A-Za-z]*(?:Error|Exception)|error)(?: \[\w+\])?:/.test(line)

function lastIndexOf (lines: readonly string[], test: (line: string) => boolean): number {
  for (let i = lines.length - 1; i >= 0; i--) if (test(lines[i] as string)) return i
  return -1
}

/**
 * What a death's stderr says killed it: the last error line Node printed, and, for an 'error'
 * event nobody listened to, the emitter.
 */
export function fatalError (stderr: string): string | null {
  const lines = stderr.split('\n')
  const at = lastIndexOf(lines, isErrorLine)
  const error = at === -1 ? null : (lines[at] as string).replace(/^<ref \*\d+> /, '').trim().slice(0, 200)
  const emitter = /Emitted 'error' event on (\S+) instance/.exec(stderr)?.[1]
  if (emitter === undefined) return error
  return `${error ?? 'an error'}, an 'error' event on a ${emitter} with no listener`
}
