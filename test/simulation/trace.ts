import { now } from './clock.js'

/** What happened in one run, in virtual time: printed when a run breaks an invariant. */
export class Trace {
  readonly lines: string[] = []

  /** `origin`: the virtual time the run started at; lines show the time since. */
  constructor (private readonly origin: number) {}

  log (line: string): void {
    this.lines.push(`${String(now() - this.origin).padStart(6)} ms  ${line}`)
  }

  toString (): string {
    return this.lines.join('\n')
  }
}
