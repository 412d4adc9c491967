import type { Crash } from './history.js'

/**
 * Processes of the harness that died without being killed by it. A crash is a finding: unless its
 * cause is a known defect outside the plugin, the checker reports it as a violation.
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
  return { process, at, exit: signal ?? String(code), knownCause: known?.cause ?? null, stderr: lastLines }
}
