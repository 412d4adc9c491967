// The project's test command (`npm test`):
//   1. start throwaway PostgreSQL / Redis / Redis Cluster (scripts/services.mjs),
//      unless DATABASE_URL / REDIS_URL / REDIS_CLUSTER_NODES are already set;
//   2. type-check (tsc --noEmit -p .) and build the package (dist/, which the docs and
//      package tests consume as a user's project would); install test/orm/'s own
//      dependencies (drizzle-orm, for the ORM recipes) when they are missing or stale;
//   3. run tap with the services' env on the whole suite, or on one tier of it
//      (`npm test -- --tier=fast`, `--tier=slow`; see SLOW_TIER below); other args go to
//      tap (`npm test -- test/plugin/replay.test.ts` runs one file);
//   4. stop the services and print `N passed, N failed[, N skipped]` as the last line.
// Exit status is tap's (1 if tap produced no summary or anything else went wrong).

import { spawn } from 'node:child_process'
import { existsSync, readdirSync, readFileSync, rmSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { startServices } from './services.mjs'
import { tapFailures } from './tap-failures.mjs'

// Recursion guard: if tap ever picks this file up as a test (its default include
// matches `**/test.*`), do nothing instead of starting a nested run.
if (process.env.IDEM_TEST_RUNNER === '1') {
  process.stdout.write('1..0 # SKIP scripts/test.mjs is the test runner, not a test\n')
  process.exit(0)
}

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')
process.chdir(root)

/**
 * The slow tier: test files that take minutes, or whose subject is the same on every Node line
 * (the benchmark scripts, the docs' code, the package's tarball), so that CI (.ci/run) runs them
 * once, on the newest LTS line, and the fast tier (every other file under test/) on every
 * supported line. A file not named here is in the fast tier. Times from a slow-tier run on a
 * 2-core machine, the six files at once:
 */
const SLOW_TIER = [
  'test/chaos/chaos.test.ts', // 4-5 min: quick chaos runs, 3 instances each, on both PostgreSQL clients
  'test/benchmarks/benchmarks.test.ts', // 1-1.5 min: the benchmark scripts' --quick runs
  'test/docs/docs.test.ts', // 15-35 s: tsc over the docs' TypeScript, the README's citations and links
  'test/package/package.test.ts', // 25-35 s: npm pack, and the packed package in a project of its own
  'test/postgres/orm-recipes.test.ts', // the docs' ORM recipes, against test/orm's own drizzle-orm
  'test/benchmarks/fingerprint-benchmark.test.ts' // the fingerprint benchmark's --quick run
]
const TIERS = ['fast', 'slow']

/** Every test file under test/ (what tap's include matches), sorted; dependencies' folders skipped. */
function allTestFiles (dir = 'test') {
  const found = []
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const at = `${dir}/${entry.name}`
    if (entry.isDirectory()) {
      if (entry.name !== 'node_modules') found.push(...allTestFiles(at))
    } else if (entry.name.endsWith('.test.ts')) {
      found.push(at)
    }
  }
  return found.sort()
}

/** The test files of `tier` ('fast' or 'slow'). */
function tierFiles (tier) {
  const all = allTestFiles()
  const missing = SLOW_TIER.filter((file) => !all.includes(file))
  if (missing.length > 0) {
    throw new Error(`SLOW_TIER in scripts/test.mjs names ${missing.join(', ')}, which ${missing.length === 1 ? 'is' : 'are'} not a test file: moved or renamed?`)
  }
  return all.filter((file) => SLOW_TIER.includes(file) === (tier === 'slow'))
}

/** `--tier=X` / `--tier X` taken out of the args; the rest go to tap. */
function parseArgs (argv) {
  const rest = []
  let tier = null
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]
    const value = arg === '--tier' ? argv[++i] : arg.startsWith('--tier=') ? arg.slice('--tier='.length) : undefined
    if (value === undefined && arg !== '--tier') { rest.push(arg); continue }
    if (!TIERS.includes(value)) throw new Error(`--tier takes ${TIERS.join(' or ')} (both run when no tier is given), not ${JSON.stringify(value ?? '')}`)
    tier = value
  }
  // A positional argument naming something on disk: a test file or folder for tap to run.
  const named = rest.filter((arg) => !arg.startsWith('-') && existsSync(arg))
  if (tier !== null && named.length > 0) throw new Error(`--tier=${tier} picks the files itself; name test files or a tier, not both (${named.join(' ')})`)
  // Without a tier, tap picks the files (its include, or the files named).
  return { tier, rest, files: tier === null ? null : tierFiles(tier) }
}

let args
try {
  args = parseArgs(process.argv.slice(2))
} catch (err) {
  process.stderr.write(`[test] ${err.message}\n`)
  process.stdout.write('0 passed, 1 failed\n')
  process.exit(1)
}

// --include only applies when no files are named: it keeps tap off scripts/test.mjs and off
// helper modules under test/.
// Test files run on tsx (as the fixtures and scripts they spawn do), except in a run that records
// coverage (below), not on tap's TypeScript plugin: its ts-node transpiles every module afresh in every test process, more than a second of
// CPU per file on this suite, where tsx caches what it compiled. The plugin's child-side switch
// TAP_TYPE_STRIP_ONLY=1 turns ts-node off (tap's runner would set it back to 0 on Node 20).
// Test files spend about half their time waiting (timers, the database, the processes they
// spawn), so tap runs twice as many at once as there are cores, unless told otherwise (--jobs).
const jobsGiven = args.rest.some((arg) => /^(--jobs|-j)/.test(arg))
const jobs = Math.min(8, 2 * os.availableParallelism())
// Coverage (.taprc) is recorded and gated (scripts/coverage.mjs) on a whole-suite run only: a
// tier or a few files cover part of the code by design.
const coverage = args.tier === null && !args.rest.some((arg) => !arg.startsWith('-') && existsSync(arg))
const tapArgs = [
  ...(coverage ? [] : ['--disable-coverage']), '--reporter=tap', '--timeout=120',
  // c8 cannot map tsx's builds back to the source: a run that records coverage stays on ts-node.
  ...(coverage ? [] : ['--test-env=TAP_TYPE_STRIP_ONLY=1', '--node-arg=--import=tsx']),
  '--include=test/**/*.test.ts',
  ...(jobsGiven ? [] : [`--jobs=${jobs}`]),
  ...args.rest,
  ...(args.files ?? [])
]

let services = null // { env, stop }
let tapChild = null
let captured = '' // tail of tap's stdout, for the summary
const failures = tapFailures() // every failed test's path, printed before the summary
let finishing = false
const extraFailures = [] // checks run after tap (the coverage gate), reported with tap's failures

const CAPTURE_LIMIT = 256 * 1024
const FAILURES_SHOWN = 40

function stopServices () {
  if (services) services.stop.sync()
}

/** Parse tap's closing `# { total: 5, pass: 3, fail: 1, skip: 1 }` line (the last one wins). */
function parseSummary (text) {
  const re = /^#\s*\{([^{}\n]*)\}\s*$/gm
  let last = null
  for (let m; (m = re.exec(text));) {
    const counts = {}
    for (const kv of m[1].matchAll(/([A-Za-z_$][\w$]*|'[^']*'|"[^"]*")\s*:\s*(\d+)/g)) {
      counts[kv[1].replace(/^['"]|['"]$/g, '')] = Number(kv[2])
    }
    if ('total' in counts || 'pass' in counts || 'fail' in counts) last = counts
  }
  return last
}

function summaryLine (counts, exitCode) {
  if (!counts) return '0 passed, 1 failed'
  const pass = counts.pass ?? 0
  let failed = counts.fail ?? 0
  // tap failed without counting a failed assertion (e.g. a crashed file): don't report success
  if (exitCode !== 0 && failed === 0) failed = 1
  const skip = counts.skip ?? 0
  return `${pass} passed, ${failed} failed${skip > 0 ? `, ${skip} skipped` : ''}`
}

const tapRunning = () => tapChild && tapChild.exitCode === null && tapChild.signalCode === null

/**
 * tap runs in its own process group (so we decide when it dies); kill the whole
 * group: SIGTERM, then SIGKILL after a grace period (tap waits for its test
 * processes on SIGTERM).
 */
function killTap () {
  if (!tapRunning()) return
  const group = -tapChild.pid
  try { process.kill(group, 'SIGTERM') } catch {}
  const deadline = Date.now() + 3000
  const nap = new Int32Array(new SharedArrayBuffer(4))
  while (Date.now() < deadline) {
    try { process.kill(group, 0) } catch { return } // group is gone
    if (groupAllZombies(tapChild.pid)) return
    Atomics.wait(nap, 0, 0, 50)
  }
  try { process.kill(group, 'SIGKILL') } catch {}
}

/** True when no live (non-zombie) process is left in process group `pgid`. */
function groupAllZombies (pgid) {
  try {
    for (const pid of readdirSync('/proc')) {
      if (!/^\d+$/.test(pid)) continue
      let stat
      try { stat = readFileSync(`/proc/${pid}/stat`, 'utf8') } catch { continue }
      const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ') // state ppid pgrp …
      if (Number(fields[2]) === pgid && fields[0] !== 'Z') return false
    }
    return true
  } catch {
    return false
  }
}

/** Stop everything, print the final line last, and exit. */
function finish (exitCode, counts = parseSummary(captured)) {
  if (finishing) return
  finishing = true
  killTap()
  stopServices()
  if (!counts && exitCode === 0) exitCode = 1
  const failed = [...failures.end(), ...extraFailures]
  if (extraFailures.length > 0 && exitCode === 0) exitCode = 1
  // an assertion's name can hold a whole command's output: one line each, cut short
  const shown = failed.slice(0, FAILURES_SHOWN).map((f) => `[failed] ${f.length > 240 ? `${f.slice(0, 239)}…` : f}\n`).join('')
  const more = failed.length > FAILURES_SHOWN ? `[failed] … and ${failed.length - FAILURES_SHOWN} more\n` : ''
  const line = summaryLine(counts, exitCode) + '\n'
  process.stdout.write(shown + more + line, () => process.exit(exitCode))
  // if stdout is gone (EPIPE) the callback may never run
  setTimeout(() => process.exit(exitCode), 2000).unref()
}

for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP']) {
  process.on(sig, () => {
    process.stderr.write(`\n[test] received ${sig}, stopping…\n`)
    finish(128 + (os.constants.signals[sig] ?? 1))
  })
}
process.on('uncaughtException', (err) => {
  process.stderr.write(`[test] uncaught error: ${err?.stack ?? err}\n`)
  finish(1)
})
process.on('unhandledRejection', (err) => {
  process.stderr.write(`[test] unhandled rejection: ${err?.stack ?? err}\n`)
  finish(1)
})
// last resort (e.g. someone calls process.exit); both are idempotent
process.on('exit', () => { killTap(); stopServices() })

/** Run a command, collecting its combined output. */
function capture (cmd, args, cwd = undefined) {
  return new Promise((resolve) => {
    let out = ''
    const child = spawn(cmd, args, { cwd, stdio: ['ignore', 'pipe', 'pipe'] })
    child.stdout.on('data', (d) => { out += d })
    child.stderr.on('data', (d) => { out += d })
    child.on('error', (err) => resolve({ code: 1, out: out + String(err.message) }))
    child.on('close', (code) => resolve({ code: code ?? 1, out }))
  })
}

async function typecheck () {
  const tsc = path.join('node_modules', 'typescript', 'bin', 'tsc')
  if (!existsSync(tsc)) return { code: 1, out: 'typescript is not installed (run npm ci)' }
  if (process.env.SKIP_TYPECHECK === '1') {
    process.stderr.write('[test] SKIP_TYPECHECK=1, skipping the type check\n')
    return { code: 0, out: '' }
  }
  if (!existsSync('tsconfig.json')) {
    process.stderr.write('[test] no tsconfig.json, skipping the type check\n')
    return { code: 0, out: '' }
  }
  const t0 = Date.now()
  const r = await capture(process.execPath, [tsc, '--noEmit', '-p', '.'])
  if (r.code === 0) process.stderr.write(`[test] type check passed (${((Date.now() - t0) / 1000).toFixed(1)} s)\n`)
  return r
}

/** A clean build of the package: the docs, package and module-format tests check dist/, so it must be current. */
async function build () {
  const tsc = path.join('node_modules', 'typescript', 'bin', 'tsc')
  if (!existsSync(tsc)) return { code: 1, out: 'typescript is not installed (run npm ci)' }
  const t0 = Date.now()
  rmSync('dist', { recursive: true, force: true })
  const r = await capture(process.execPath, [tsc, '-p', 'tsconfig.build.json'])
  if (r.code === 0) process.stderr.write(`[test] build passed (${((Date.now() - t0) / 1000).toFixed(1)} s)\n`)
  return r
}

/**
 * test/orm/ is a project of its own, holding drizzle-orm for the ORM recipe tests: drizzle's optional
 * peers (react-native, through op-sqlite) conflict with tap's react 18, so as a root devDependency
 * `npm install` fails with ERESOLVE, and --legacy-peer-deps at the root would break `npm ci`. Its
 * `npm ci` (legacy-peer-deps, from its .npmrc) runs quietly, and only when a package its lockfile
 * names is missing or at another version.
 */
async function ormDependencies () {
  const dir = path.join('test', 'orm')
  let lock
  try { lock = JSON.parse(readFileSync(path.join(dir, 'package-lock.json'), 'utf8')) } catch (err) {
    return { code: 1, out: `cannot read test/orm/package-lock.json: ${err.message}` }
  }
  const stale = Object.entries(lock.packages ?? {}).filter(([where]) => where.startsWith('node_modules/')).some(([where, meta]) => {
    try { return JSON.parse(readFileSync(path.join(dir, where, 'package.json'), 'utf8')).version !== meta.version } catch { return true }
  })
  if (!stale) return { code: 0, out: '' }
  const t0 = Date.now()
  // The npm running `npm test`, else the one on PATH.
  const [cmd, pre] = process.env.npm_execpath ? [process.execPath, [process.env.npm_execpath]] : ['npm', []]
  const r = await capture(cmd, [...pre, 'ci', '--no-audit', '--no-fund', '--loglevel=error'], dir)
  if (r.code === 0) process.stderr.write(`[test] npm ci in test/orm passed (${((Date.now() - t0) / 1000).toFixed(1)} s)\n`)
  return r
}

function tapCommand () {
  try {
    const pkgFile = path.join('node_modules', 'tap', 'package.json')
    const pkg = JSON.parse(readFileSync(pkgFile, 'utf8'))
    const bin = typeof pkg.bin === 'string' ? pkg.bin : pkg.bin?.tap
    if (bin) {
      const file = path.join('node_modules', 'tap', bin)
      if (existsSync(file)) return [process.execPath, [file, ...tapArgs]]
    }
  } catch {}
  return ['npx', ['--no-install', 'tap', ...tapArgs]]
}

function runTap (env) {
  return new Promise((resolve) => {
    const [cmd, args] = tapCommand()
    tapChild = spawn(cmd, args, { env, stdio: ['inherit', 'pipe', 'pipe'], detached: true })
    const keep = (d) => {
      captured += d
      if (captured.length > CAPTURE_LIMIT * 2) captured = captured.slice(-CAPTURE_LIMIT)
    }
    tapChild.stdout.on('data', (d) => { process.stdout.write(d); keep(d); failures.write(String(d)) })
    tapChild.stderr.on('data', (d) => { process.stderr.write(d) })
    let code = null
    const done = () => resolve(code)
    tapChild.on('error', (err) => {
      process.stderr.write(`[test] could not run tap: ${err.message}\n`)
      code = 1
      done()
    })
    tapChild.on('exit', (c, signal) => {
      code = c ?? 128 + (os.constants.signals[signal] ?? 1)
      // wait for the pipes to drain, but not forever (a test may leave a
      // grandchild holding them open)
      const t = setTimeout(done, 3000)
      tapChild.on('close', () => { clearTimeout(t); done() })
    })
  })
}

async function main () {
  const [svc, tc, bd, orm] = await Promise.allSettled([startServices(), typecheck(), build(), ormDependencies()])
  if (svc.status === 'fulfilled') services = svc.value
  if (svc.status === 'rejected') {
    process.stderr.write(`[test] could not start the test services:\n${svc.reason?.message ?? svc.reason}\n`)
    return finish(1, null)
  }
  if (tc.status === 'rejected' || tc.value.code !== 0) {
    const out = tc.status === 'rejected' ? String(tc.reason) : tc.value.out
    process.stdout.write(out.endsWith('\n') || !out ? out : out + '\n')
    process.stderr.write('[test] type check failed (tsc --noEmit -p .), not running the tests\n')
    return finish(1, null)
  }
  if (bd.status === 'rejected' || bd.value.code !== 0) {
    const out = bd.status === 'rejected' ? String(bd.reason) : bd.value.out
    process.stdout.write(out.endsWith('\n') || !out ? out : out + '\n')
    process.stderr.write('[test] build failed (tsc -p tsconfig.build.json), not running the tests\n')
    return finish(1, null)
  }
  if (orm.status === 'rejected' || orm.value.code !== 0) {
    const out = orm.status === 'rejected' ? String(orm.reason) : orm.value.out
    process.stdout.write(out.endsWith('\n') || !out ? out : out + '\n')
    process.stderr.write('[test] npm ci in test/orm failed (drizzle-orm, for the ORM recipe tests), not running the tests\n')
    return finish(1, null)
  }
  if (args.files !== null) process.stderr.write(`[test] the ${args.tier} tier: ${args.files.length} test files\n`)
  const code = await runTap({ ...process.env, ...services.env, IDEM_TEST_RUNNER: '1' })
  if (coverage) {
    const report = await capture(process.execPath, [path.join('scripts', 'coverage.mjs')])
    process.stdout.write(report.out.endsWith('\n') || !report.out ? report.out : report.out + '\n')
    if (report.code !== 0) extraFailures.push(`coverage: ${report.out.trim().split('\n').at(-1)}`)
  }
  finish(code ?? 1)
}

main().catch((err) => {
  process.stderr.write(`[test] ${err?.stack ?? err}\n`)
  finish(1, null)
})
