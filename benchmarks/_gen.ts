import { spawn } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import autocannon from 'autocannon'
import { pinning } from './pinning.js'
import { BODY } from './route.js'
import { startBenchServer } from './server-process.js'
import { measuredCpuMs } from './measured-cpu.js'

const PIN = pinning('pin')
const ROUNDS = Number(process.env.ROUNDS ?? 3)
const SECS = Number(process.env.SECS ?? 1)
let counter = 0
let runs = 0
type Gen = 'autocannon' | 'wrk-t2' | 'wrk-t1' | 'wrk-light-t2' | 'wrk-light-t1'
const GENS: Gen[] = ['autocannon', 'wrk-t2', 'wrk-t1', 'wrk-light-t2', 'wrk-light-t1']
async function drive (gen: Gen, url: string): Promise<number> {
  if (gen === 'autocannon') {
    const r = await autocannon({ url, connections: 10, duration: SECS, sampleInt: 100, headers: { 'content-type': 'application/json' }, body: BODY,
      requests: [{ method: 'POST', path: '/pay', setupRequest (req) { (req.headers ??= {})['idempotency-key'] = `"a-${counter++}"`; return req } }] })
    if (r.non2xx > 0 || r.errors > 0) throw new Error('autocannon errors')
    return r.requests.total
  }
  const light = gen.startsWith('wrk-light')
  const t = gen.endsWith('t1') ? '1' : '2'
  const [cmd, argv] = PIN.generator('wrk', ['-t', t, '-c', '10', '-d', `${SECS}s`, '-s', light ? '/tmp/exp/light.lua' : '/work/main/benchmarks/crosscheck.lua', `${url}/pay`])
  const out = await new Promise<string>((resolve, reject) => {
    const c = spawn(cmd, argv, { env: { ...process.env, CROSSCHECK_MODE: 'fresh', CROSSCHECK_TAG: randomBytes(3).toString('hex'), CROSSCHECK_RUN: String(runs++), CROSSCHECK_BODY: BODY }, stdio: ['ignore', 'pipe', 'inherit'] })
    let o = ''; c.stdout.on('data', (d) => { o += d }); c.once('exit', (code) => code === 0 ? resolve(o) : reject(new Error(o)))
  })
  const s = JSON.parse(/CROSSCHECK (\{.*\})/.exec(out)![1]!) as { requests: number, status: number }
  if (s.status > 0) throw new Error('wrk status errors')
  return s.requests
}
const SL = Number(process.env.SLICES ?? 4)
const GS: Gen[] = ['autocannon', 'wrk-t2']
const quads: Array<Record<string, { rate: number, cpu: number, busy: number }>> = []
for (let round = 0; round < ROUNDS; round++) {
  const servers: Record<string, Awaited<ReturnType<typeof startBenchServer>>> = {}
  for (const setup of ['bare', 'memory']) servers[setup] = await startBenchServer({ pin: PIN, env: { SETUP: setup, BENCH_PAYLOAD: '200' }, label: setup })
  for (const setup of ['bare', 'memory']) { await drive('autocannon', servers[setup]!.url); await drive('wrk-t2', servers[setup]!.url) }
  const cells = ['bare', 'memory'].flatMap((setup) => GS.map((gen) => [setup, gen] as const))
  for (let slice = 0; slice < SL; slice++) {
    const q: Record<string, { rate: number, cpu: number, busy: number }> = {}
    for (let i = 0; i < cells.length; i++) {
      const [setup, gen] = cells[(i + slice + round) % cells.length]!
      const server = servers[setup]!
      const before = measuredCpuMs(server.pid)!
      const t0 = process.hrtime.bigint()
      const n = await drive(gen, server.url)
      const secs = Number(process.hrtime.bigint() - t0) / 1e9
      const cpu = measuredCpuMs(server.pid)! - before
      q[`${setup} ${gen}`] = { rate: n / SECS, cpu: cpu * 1000 / n, busy: cpu / 1000 / secs }
    }
    quads.push(q)
    process.stderr.write(Object.entries(q).map(([k, v]) => `${k} ${Math.round(v.rate)} ${v.cpu.toFixed(1)}µs ${(v.busy * 100).toFixed(0)}%`).join(' | ') + '\n')
  }
  for (const s of Object.values(servers)) await s.stop()
}
const med = (a: number[]): number => { const s = [...a].sort((x, y) => x - y); return s.length % 2 ? s[s.length >> 1]! : (s[s.length / 2 - 1]! + s[s.length / 2]!) / 2 }
for (const gen of GS) {
  const ratio = med(quads.map((q) => q[`memory ${gen}`]!.rate / q[`bare ${gen}`]!.rate))
  const cpuRatio = med(quads.map((q) => q[`bare ${gen}`]!.cpu / q[`memory ${gen}`]!.cpu))
  console.log(`${gen}: memory/bare ${ratio.toFixed(3)} per CPU ${cpuRatio.toFixed(3)}; bare ${Math.round(med(quads.map((q) => q[`bare ${gen}`]!.rate)))} req/s ${med(quads.map((q) => q[`bare ${gen}`]!.cpu)).toFixed(1)} µs busy ${med(quads.map((q) => q[`bare ${gen}`]!.busy)).toFixed(2)}; memory ${Math.round(med(quads.map((q) => q[`memory ${gen}`]!.rate)))} req/s ${med(quads.map((q) => q[`memory ${gen}`]!.cpu)).toFixed(1)} µs busy ${med(quads.map((q) => q[`memory ${gen}`]!.busy)).toFixed(2)}`)
}
console.log('wrk÷autocannon bare rate', med(quads.map((q) => q['bare wrk-t2']!.rate / q['bare autocannon']!.rate)).toFixed(3), 'bare cpu', med(quads.map((q) => q['bare wrk-t2']!.cpu / q['bare autocannon']!.cpu)).toFixed(3), 'memory rate', med(quads.map((q) => q['memory wrk-t2']!.rate / q['memory autocannon']!.rate)).toFixed(3), 'memory cpu', med(quads.map((q) => q['memory wrk-t2']!.cpu / q['memory autocannon']!.cpu)).toFixed(3))
