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
  const lastLines = stderrTail.trimEnd().split('\n').slice(-12).join('\n')
  return { process, at, exit: signal ?? String(code), knownCause: known?.cause ?? null, stderr: lastLines, error: fatalError(stderrTail) }
}

/**
 * What a death's stderr says killed it: the last unindented error line Node printed (`TypeError: …`,
 * `Error: …`; stack lines are indented), and, for an 'error' event nobody listened to, the emitter.
 */
export function fatalError (stderr: string): string | null {
  const errors = stderr.split('\n').filter((line) => /^(?:Uncaught )?[A-Za-z]*(?:Error|Exception)\b/.test(line))
  const error = errors[errors.length - 1]?.trim().slice(0, 200) ?? null
  const emitter = /Emitted 'error' event on (\S+) instance/.exec(stderr)?.[1]
  if (emitter === undefined) return error
  return `${error ?? 'an error'}, an 'error' event on a ${emitter} with no listener`
}
