import { execFile } from 'node:child_process'
import { fileURLToPath } from 'node:url'
import t from 'tap'
import { PLANTS, PLANT_VIOLATIONS } from './plants.js'

/*
 * The deterministic simulation of the request lifecycle (test/simulation/README.md): thousands of
 * seeds against the real plugin on a virtual clock, every one checked against the invariants, and
 * the planted bugs each found within the seeds. Each run is a process of its own: the simulation
 * replaces the timers of the process it runs in.
 */

const CLI = fileURLToPath(new URL('./cli.ts', import.meta.url))

interface Summary {
  readonly runs: number
  readonly violations: ReadonlyArray<{ seed: number, kind: string, detail: string }>
  readonly coverage: Readonly<Record<string, number>>
  readonly ms: number
}

function simulate (args: readonly string[]): Promise<{ summary: Summary, output: string }> {
  return new Promise((resolve, reject) => {
    execFile(process.execPath, ['--import', 'tsx', CLI, ...args], { maxBuffer: 256 * 1024 * 1024 }, (err, stdout) => {
      const lines = stdout.trim().split('\n')
      try {
        resolve({ summary: JSON.parse(lines[lines.length - 1] ?? '') as Summary, output: stdout })
      } catch {
        reject(err ?? new Error(`no summary from the simulation: ${stdout.slice(-2000)}`))
      }
    })
  })
}

/** What every CI run must have gone through, with the seeds it tries. */
const CROSSED = {
  claimLandedWhileAnotherAnswerWentOut: 'a claim landed after another answer (a handlerTimeout) went out',
  claimLandedAfterAnswer: 'a claim landed after its request was answered (timeout, storeTimeout)',
  completeFailedPastItsRetries: 'recording the answer failed past the tries the client waits for',
  clientLeftBeforeClaim: 'the client left before the claim landed',
  clientLeftDuringHandler: 'the client left while the handler ran',
  timeoutWhile_parsed: 'handlerTimeout fired before the claim landed',
  timeoutWhile_owner: 'handlerTimeout fired while the handler ran',
  timeoutWhile_settling: 'handlerTimeout fired while the answer was being settled',
  takeover: 'a lapsed lease was taken over',
  takeoverGivenBack: 'a takeover that landed too late was given back with its steps',
  held: 'a key was held for the reconciler',
  atomicInProgress: 'an atomic claim found the key locked by another transaction',
  replayFromCopy: 'a replay came from the pre-filter\'s copy',
  job: 'a key went through the job door',
  jobReplayed: 'a job\'s run got the recorded value',
  jobInProgress: 'a job\'s run was refused while another held its key',
  jobTakeover: 'a job\'s lapsed lease was taken over',
  jobHeld: 'a job\'s key was held for the reconciler'
} as const

t.test('3000 seeds: every invariant holds, and the runs cross every boundary named', async (t) => {
  const { summary, output } = await simulate(['--seeds', '3000'])
  t.equal(summary.runs, 3000, 'every seed ran')
  t.same(summary.violations, [], summary.violations.length === 0 ? 'no violation' : output.slice(0, 20_000))
  for (const [name, what] of Object.entries(CROSSED)) {
    t.ok((summary.coverage[name] ?? 0) > 0, `${what}: ${summary.coverage[name] ?? 0} runs`)
  }
  t.comment(`simulation: ${summary.runs} seeds in ${summary.ms} ms; runs that crossed each boundary: ${JSON.stringify(summary.coverage)}`)
})

for (const plant of PLANTS) {
  t.test(`planted bug ${plant}: found within the seeds`, async (t) => {
    const { summary } = await simulate(['--plant', plant, '--seeds', '2000'])
    const found = summary.violations.filter((violation) => PLANT_VIOLATIONS[plant].includes(violation.kind))
    t.ok(found.length > 0, `a violation (${PLANT_VIOLATIONS[plant].join(' or ')}) within ${summary.runs} seeds: ${JSON.stringify(summary.violations[0] ?? null)}`)
  })
}

t.test('a seed replays by its number: the same trace alone as among other seeds', async (t) => {
  const batch = await simulate(['--from', '40', '--seeds', '3', '--trace'])
  const alone = await simulate(['--seed', '41', '--trace'])
  const traceOf = (output: string): string => output.split('=== seed 41\n')[1]?.split('\n=== seed')[0]?.split('\n{"runs"')[0] ?? ''
  t.ok(traceOf(alone.output).length > 0, 'a trace was printed')
  t.equal(traceOf(batch.output), traceOf(alone.output), 'identical, line for line')
})
