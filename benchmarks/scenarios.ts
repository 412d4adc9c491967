/**
 * The scenarios of `npm run bench`: the setups each measures, the floor each setup is held to, the
 * keys its requests carry, and what a measurement must show to count. A wrong answer (an execution
 * too many, a floor's statement count off, which would mean the counting itself is wrong) fails the run.
 */

export const SETUPS = ['bare', 'memory', 'peer-memory', 'pg-lease', 'pg-atomic', 'pg-redis', 'pg-redis-unpipelined', 'peer-redis', 'floor-sql', 'floor-select', 'floor-txn'] as const
export type Setup = typeof SETUPS[number]

export interface Timing { rounds: number, slices: number, sliceSeconds: number, warmupSeconds: number }

/**
 * What a check sees of one measurement: requests answered over the measured load and its slices,
 * handler executions over it and since before the warm-up, the probe's statements per request.
 */
export interface Outcome { setup: Setup, requests: number, slices: number, executions: number, executionsWithWarmup: number, pgStatements: number | null }

/** `payload`: the response's size in bytes; `floors`: the floor each setup is held to. */
export interface Scenario {
  name: string
  description: string
  payload: number
  connections: number
  timing: Timing
  setups: readonly Setup[]
  floors: Partial<Record<Setup, Setup>>
  /** Runs once against each new server, before its warm-up: `post` sends one request with a key. */
  prepare?: (post: (key: string) => Promise<number>, tag: string) => Promise<void>
  /** The key generator of one measurement (warm-up and load); `tag` is unique to it. */
  keys: (tag: string) => () => string
  /** The sequential probe's i-th key (none: not probed). */
  probeKey?: (i: number, tag: string) => string
  /** 409 is a correct answer (a duplicate in flight). */
  conflicts?: boolean
  check: (outcome: Outcome) => string[]
}

const STORM = { connections: 200, keys: 20 }
const KiB = 1024
const MiB = 1024 * KiB
const ALL: readonly Setup[] = ['bare', 'memory', 'peer-memory', 'pg-lease', 'pg-atomic', 'pg-redis', 'pg-redis-unpipelined', 'peer-redis']
/** The cost curve over connections and body sizes runs these only, to bound the run's length. */
const SCALE: readonly Setup[] = ['bare', 'memory', 'peer-memory', 'pg-lease']

/**
 * The peer's Fastify adapter runs the handler for a replay whose client disconnected (peer-glue.ts),
 * and every load ends by closing its connections: its executions are not checked.
 */
const ours = (setup: Setup): boolean => !setup.startsWith('peer-')

function floorCount (outcome: Outcome, expected: Partial<Record<Setup, number>>): string[] {
  const want = expected[outcome.setup]
  if (want === undefined || (outcome.pgStatements !== null && Math.abs(outcome.pgStatements - want) < 0.005)) return []
  return [`${outcome.pgStatements} statements per request where the floor runs ${want}: the counting is wrong`]
}

const size = (bytes: number): string => bytes >= MiB ? `${bytes / MiB} MiB` : bytes >= KiB ? `${bytes / KiB} KiB` : `${bytes} B`

interface Shape { name: string, payload: number, connections: number, timing: Timing, setups: readonly Setup[], floors?: Partial<Record<Setup, Setup>>, replayKeys: number }

function fresh ({ floors = {}, replayKeys: _, ...shape }: Shape): Scenario {
  return {
    ...shape,
    floors,
    description: `every request a new key; ${size(shape.payload)} responses, ${shape.connections} connection(s)`,
    keys: (tag) => { let i = 0; return () => `"k-${i++}-${tag}"` },
    probeKey: (i, tag) => `"p-${i}-${tag}"`,
    // A request in flight when a slice stops still executes: up to one per connection per slice.
    check: (o) => [
      ...Math.abs(o.executions - o.requests) <= (o.slices + 1) * shape.connections || !ours(o.setup) ? [] : [`${o.executions} executions for ${o.requests} fresh keys`],
      ...floorCount(o, { 'floor-sql': 2, 'floor-txn': 5 })
    ]
  }
}

function replay ({ floors = {}, replayKeys, ...shape }: Shape): Scenario {
  const key = (i: number, tag: string): string => `"r-${i % replayKeys}-${tag}"`
  return {
    ...shape,
    floors,
    description: `requests cycle over ${replayKeys} keys completed beforehand; ${size(shape.payload)} responses, ${shape.connections} connection(s)`,
    async prepare (post, tag) {
      for (let i = 0; i < replayKeys; i += 10) {
        const statuses = await Promise.all(Array.from({ length: Math.min(10, replayKeys - i) }, async (_, j) => await post(key(i + j, tag))))
        if (statuses.some((status) => status !== 201)) throw new Error(`replay preparation: ${statuses.join(', ')}`)
      }
    },
    keys: (tag) => { let i = 0; return () => key(i++, tag) },
    probeKey: key,
    check: (o) => [
      ...o.setup === 'bare' || o.executions === 0 || !ours(o.setup) ? [] : [`${o.executions} executions during replays`],
      ...floorCount(o, { 'floor-select': 1 })
    ]
  }
}

function storm (timing: Timing): Scenario {
  return {
    name: 'storm',
    description: `${STORM.connections} connections on ${STORM.keys} keys (409 while in flight, then replays); 200 B responses`,
    payload: 200,
    connections: STORM.connections,
    timing,
    setups: ['bare', 'pg-lease', 'pg-redis', 'pg-redis-unpipelined', 'peer-redis'],
    floors: {},
    conflicts: true,
    keys: (tag) => { let i = 0; return () => `"s-${i++ % STORM.keys}-${tag}"` },
    check: (o) => o.setup === 'bare' || o.executionsWithWarmup === STORM.keys || !ours(o.setup) ? [] : [`${o.executionsWithWarmup} executions for ${STORM.keys} keys`]
  }
}

/**
 * Every scenario. Full: `rounds` rounds of 4 one-second slices after 3 s of warm-up (the cost
 * curve: at most 3 rounds of 2 slices after 2 s). Quick: one short slice, for the test suite.
 */
export function scenarios (quick: boolean, rounds: number): Scenario[] {
  const main: Timing = quick ? { rounds: 1, slices: 1, sliceSeconds: 0.3, warmupSeconds: 0.1 } : { rounds, slices: 4, sliceSeconds: 1, warmupSeconds: 3 }
  const scale: Timing = quick ? { rounds: 1, slices: 1, sliceSeconds: 0.2, warmupSeconds: 0.05 } : { rounds: Math.min(rounds, 3), slices: 2, sliceSeconds: 1, warmupSeconds: 2 }
  const base = { payload: 200, connections: 10, timing: main, replayKeys: quick ? 20 : 100 }
  const curve = { ...base, timing: scale, setups: SCALE }
  return [
    fresh({ ...base, name: 'fresh', setups: [...ALL, 'floor-sql', 'floor-txn'], floors: { 'pg-lease': 'floor-sql', 'pg-redis': 'floor-sql', 'pg-atomic': 'floor-txn' } }),
    replay({ ...base, name: 'replay', setups: [...ALL, 'floor-select'], floors: { 'pg-lease': 'floor-select', 'pg-redis': 'floor-select', 'pg-atomic': 'floor-select' } }),
    storm(main),
    fresh({ ...curve, name: 'fresh-c1', connections: 1 }),
    replay({ ...curve, name: 'replay-c1', connections: 1 }),
    fresh({ ...curve, name: 'fresh-c100', connections: 100 }),
    replay({ ...curve, name: 'replay-c100', connections: 100 }),
    fresh({ ...curve, name: 'fresh-64k', payload: 64 * KiB }),
    replay({ ...curve, name: 'replay-64k', payload: 64 * KiB }),
    fresh({ ...curve, name: 'fresh-1m', payload: MiB }),
    replay({ ...curve, name: 'replay-1m', payload: MiB })
  ]
}
