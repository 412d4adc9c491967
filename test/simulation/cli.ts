// The deterministic simulation of the request lifecycle (README.md in this folder):
//   npm run simulate -- --seeds 20000            seeds 1..20000
//   npm run simulate -- --seeds 500 --from 9000  seeds 9000..9499
//   npm run simulate -- --seed 1234 --trace      one seed, with its trace
//   npm run simulate -- --plant late-claim-kept  a planted bug: stops at the first violation
// The last line of output is a JSON summary: runs, violations, coverage, milliseconds.
import { clock } from './clock.js'

interface Arguments {
  seeds: number
  from: number
  trace: boolean
  plant: string | null
  budgetMs: number
}

function parse (argv: readonly string[]): Arguments {
  const args: Arguments = { seeds: 1000, from: 1, trace: false, plant: null, budgetMs: Infinity }
  for (let i = 0; i < argv.length; i++) {
    const name = argv[i]
    const value = (): string => {
      const next = argv[++i]
      if (next === undefined) throw new Error(`${name} needs a value`)
      return next
    }
    if (name === '--seeds') args.seeds = Number(value())
    else if (name === '--from') args.from = Number(value())
    else if (name === '--seed') { args.from = Number(value()); args.seeds = 1 } else if (name === '--trace') args.trace = true
    else if (name === '--plant') args.plant = value()
    else if (name === '--budget-ms') args.budgetMs = Number(value())
    else throw new Error(`unknown argument ${name}`)
  }
  return args
}

const args = parse(process.argv.slice(2))
const { buildInstances } = await import('./world.js')
const { simulate } = await import('./run.js')
const { PLANTS, PLANT_VIOLATIONS } = await import('./plants.js')
type Plant = typeof PLANTS[number]
if (args.plant !== null && !(PLANTS as readonly string[]).includes(args.plant)) throw new Error(`unknown plant ${args.plant}; one of ${PLANTS.join(', ')}`)
const plant = args.plant as Plant | null

const current = {} as Parameters<typeof buildInstances>[1]
const instances = await buildInstances(3, current)
const realStart = process.hrtime.bigint()
const coverage: Record<string, number> = {}
const violations: Array<{ seed: number, kind: string, detail: string }> = []
let runs = 0
let steps = 0
for (let seed = args.from; seed < args.from + args.seeds; seed++) {
  const result = await simulate(seed, instances, current, plant)
  runs++
  steps += result.steps
  for (const [name, crossed] of Object.entries(result.coverage)) if (crossed) coverage[name] = (coverage[name] ?? 0) + 1
  if (args.trace) process.stdout.write(`=== seed ${seed}\n${result.trace.toString()}\n`)
  if (result.violations.length > 0) {
    for (const violation of result.violations) violations.push({ seed, ...violation })
    process.stdout.write(`seed ${seed}: ${result.violations.map((v) => `${v.kind}: ${v.detail}`).join('; ')}\n`)
    if (!args.trace && plant === null) process.stdout.write(`${result.trace.toString()}\nreplay: npm run simulate -- --seed ${seed} --trace\n`)
    // What a broken run left behind (timers, open transactions) would spill into the next ones.
    break
  }
  if (Number(process.hrtime.bigint() - realStart) / 1e6 > args.budgetMs) break
}
const ms = Math.round(Number(process.hrtime.bigint() - realStart) / 1e6)
const expected = plant === null ? null : PLANT_VIOLATIONS[plant]
process.stdout.write(`${JSON.stringify({ runs, from: args.from, plant, expected, violations, coverage, steps, ms, virtualMs: clock.now })}\n`)
process.exitCode = plant === null && violations.length > 0 ? 1 : 0
// The instances' timers are virtual: nothing else keeps the process alive.
process.exit()
