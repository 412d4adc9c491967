// Throwaway PostgreSQL / Redis / Redis Cluster for the test suite.
//
//   import { startServices } from './services.mjs'
//   const { env, stop } = await startServices()
//   // env: DATABASE_URL, REDIS_URL, REDIS_CLUSTER_NODES, PG_BIN_DIR, REDIS_SERVER_BIN
//   await stop()
//
// Anything already provided through DATABASE_URL / REDIS_URL / REDIS_CLUSTER_NODES
// is used as is and nothing is started for it. Everything started here lives in
// fresh temp dirs on random ports and is torn down by stop(), which is idempotent,
// never throws, and is synchronous underneath (so it can also run from an
// 'exit' handler as stop.sync()).
//
// Plain Node ESM, no dependencies beyond node builtins.

import { spawn, spawnSync } from 'node:child_process'
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, realpathSync, rmSync, chownSync, accessSync, constants as fsc } from 'node:fs'
import net from 'node:net'
import os from 'node:os'
import path from 'node:path'

const WAIT_TIMEOUT_MS = 30_000
const IS_ROOT = typeof process.getuid === 'function' && process.getuid() === 0
const INSTALL_HINT =
  'Install PostgreSQL and Redis (Debian/Ubuntu: `apt-get install postgresql redis-server`; ' +
  'redis-cli comes with redis-tools), or point the tests at existing servers with ' +
  'DATABASE_URL=postgres://…, REDIS_URL=redis://… and REDIS_CLUSTER_NODES=host:port,host:port,host:port.'

const log = (msg) => process.stderr.write(`[services] ${msg}\n`)
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

// ---------------------------------------------------------------------------
// process helpers

/**
 * Run a command to completion and collect its output. Resolves on 'exit' (not
 * only 'close'): daemons started by the command may keep inherited pipes open.
 */
function run (cmd, args, { timeout = WAIT_TIMEOUT_MS, env, input } = {}) {
  return new Promise((resolve) => {
    let out = ''
    let settled = false
    let child
    try {
      child = spawn(cmd, args, { env: env ?? process.env, stdio: ['pipe', 'pipe', 'pipe'] })
    } catch (err) {
      resolve({ code: -1, out: String(err?.message ?? err) })
      return
    }
    const timer = setTimeout(() => {
      out += `\n[timed out after ${timeout} ms]`
      try { child.kill('SIGKILL') } catch {}
    }, timeout)
    const finish = (code) => {
      if (settled) return
      settled = true
      clearTimeout(timer)
      child.stdout?.destroy()
      child.stderr?.destroy()
      resolve({ code, out })
    }
    child.stdout.on('data', (d) => { out += d })
    child.stderr.on('data', (d) => { out += d })
    child.on('error', (err) => { out += String(err?.message ?? err); finish(-1) })
    child.on('exit', (code, signal) => {
      const c = code ?? (signal ? 128 + (os.constants.signals[signal] ?? 0) : 1)
      // give the pipes a moment to drain, but don't wait for daemons holding them
      let drained = false
      child.on('close', () => { drained = true; finish(c) })
      setTimeout(() => { if (!drained) finish(c) }, 250)
    })
    if (input != null) child.stdin.end(input)
    else child.stdin.end()
  })
}

function runSync (cmd, args, { timeout = 20_000 } = {}) {
  try {
    const r = spawnSync(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'], timeout, encoding: 'utf8' })
    return { code: r.status ?? -1, out: `${r.stdout ?? ''}${r.stderr ?? ''}${r.error ? String(r.error.message) : ''}` }
  } catch (err) {
    return { code: -1, out: String(err?.message ?? err) }
  }
}

/** Run as the `postgres` OS user when we are root (initdb/pg_ctl refuse root). */
function asPg (cmd, args) {
  return IS_ROOT ? ['runuser', ['-u', 'postgres', '--', cmd, ...args]] : [cmd, args]
}

function tail (file, lines = 30) {
  try {
    const text = readFileSync(file, 'utf8').trimEnd().split('\n')
    return text.slice(-lines).join('\n')
  } catch {
    return '(no log)'
  }
}

function fail (what, out, logFile) {
  let msg = `${what}`
  if (out && out.trim()) msg += `\n--- output ---\n${out.trim().split('\n').slice(-30).join('\n')}`
  if (logFile) msg += `\n--- tail of ${logFile} ---\n${tail(logFile)}`
  return new Error(msg)
}

async function waitFor (what, check, { timeout = WAIT_TIMEOUT_MS, interval = 50, logFile } = {}) {
  const deadline = Date.now() + timeout
  let last = ''
  for (;;) {
    const r = await check()
    if (r === true) return
    if (typeof r === 'string') last = r
    if (Date.now() > deadline) throw fail(`timed out after ${timeout / 1000} s waiting for ${what}`, last, logFile)
    await sleep(interval)
  }
}

// ---------------------------------------------------------------------------
// ports

function freePort () {
  return new Promise((resolve, reject) => {
    const srv = net.createServer()
    srv.unref()
    srv.on('error', reject)
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address()
      srv.close(() => resolve(port))
    })
  })
}

function portIsFree (port) {
  return new Promise((resolve) => {
    const srv = net.createServer()
    srv.unref()
    srv.once('error', () => resolve(false))
    srv.listen(port, '127.0.0.1', () => srv.close(() => resolve(true)))
  })
}

/**
 * The lowest port Linux hands out to outgoing connections (ip_local_port_range; 32768 by default).
 * A port in that range can be taken by any client's connection between our check and the server's
 * bind: a cluster node once failed on its bus port that way (CI, Node 22: "Address already in use").
 */
function ephemeralLow () {
  try {
    const low = Number(readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0])
    if (Number.isInteger(low) && low > 22000) return low
  } catch {}
  return 32768
}

/**
 * Three consecutive free ports, and their cluster-bus ports (+10000) free too, all below the
 * ephemeral range (ephemeralLow), so that no outgoing connection takes one meanwhile.
 */
async function freeClusterPorts () {
  const first = 12000
  const last = ephemeralLow() - 10000 - 3
  for (let attempt = 0; attempt < 50; attempt++) {
    const base = first + Math.floor(Math.random() * (last - first))
    const ports = [base, base + 1, base + 2]
    let ok = true
    for (const p of ports) {
      if (!(await portIsFree(p)) || !(await portIsFree(p + 10000))) { ok = false; break }
    }
    if (ok) return ports
  }
  throw new Error(`could not find 3 free consecutive ports (+ bus ports) in ${first}-${last} for Redis Cluster`)
}

// ---------------------------------------------------------------------------
// binaries

function which (name) {
  for (const dir of (process.env.PATH ?? '').split(path.delimiter)) {
    if (!dir) continue
    const p = path.join(dir, name)
    try { accessSync(p, fsc.X_OK); return p } catch {}
  }
  for (const dir of ['/usr/sbin', '/usr/bin', '/usr/local/bin', '/usr/local/sbin']) {
    const p = path.join(dir, name)
    try { accessSync(p, fsc.X_OK); return p } catch {}
  }
  return null
}

function findPgBinDir () {
  if (process.env.PG_BIN_DIR && existsSync(path.join(process.env.PG_BIN_DIR, 'pg_ctl'))) return process.env.PG_BIN_DIR
  const root = '/usr/lib/postgresql'
  try {
    const majors = readdirSync(root)
      .filter((d) => /^\d+(\.\d+)?$/.test(d))
      .sort((a, b) => parseFloat(b) - parseFloat(a))
    for (const m of majors) {
      const bin = path.join(root, m, 'bin')
      if (existsSync(path.join(bin, 'initdb')) && existsSync(path.join(bin, 'pg_ctl'))) return bin
    }
  } catch {}
  let initdb = which('initdb')
  try { if (initdb) initdb = realpathSync(initdb) } catch {} // /usr/local/bin/initdb -> …/15/bin/initdb
  if (initdb && existsSync(path.join(path.dirname(initdb), 'pg_ctl'))) return path.dirname(initdb)
  return null
}

function findRedis () {
  const server = process.env.REDIS_SERVER_BIN && existsSync(process.env.REDIS_SERVER_BIN)
    ? process.env.REDIS_SERVER_BIN
    : which('redis-server')
  const cli = server && existsSync(path.join(path.dirname(server), 'redis-cli'))
    ? path.join(path.dirname(server), 'redis-cli')
    : which('redis-cli')
  return { server, cli }
}

async function aptInstall (packages) {
  log(`installing ${packages.join(' ')} with apt-get (this can take a minute)…`)
  const env = { ...process.env, DEBIAN_FRONTEND: 'noninteractive' }
  const upd = await run('apt-get', ['update', '-qq'], { env, timeout: 300_000 })
  if (upd.code !== 0) log(`apt-get update failed (exit ${upd.code}); trying the install anyway:\n${upd.out.trim().split('\n').slice(-10).join('\n')}`)
  const inst = await run('apt-get', ['install', '-y', '-qq', '--no-install-recommends', ...packages], { env, timeout: 600_000 })
  if (inst.code !== 0) log(`apt-get install ${packages.join(' ')} failed (exit ${inst.code}):\n${inst.out.trim().split('\n').slice(-15).join('\n')}`)
}

// ---------------------------------------------------------------------------
// temp dirs

function makeTempDir (prefix, { forPostgres = false } = {}) {
  const bases = [os.tmpdir()]
  if (forPostgres && os.tmpdir() !== '/tmp') bases.push('/tmp')
  let lastErr
  for (const base of bases) {
    const dir = mkdtempSync(path.join(base, prefix))
    if (!forPostgres || !IS_ROOT) return dir
    try {
      const pw = runSync('id', ['-u', 'postgres'])
      const gw = runSync('id', ['-g', 'postgres'])
      if (pw.code !== 0) throw new Error('the `postgres` OS user does not exist (it is created by the postgresql package)')
      chownSync(dir, Number(pw.out.trim()), Number(gw.out.trim()))
      // the postgres user must be able to reach the dir (a TMPDIR under /root would not be)
      const t = runSync('runuser', ['-u', 'postgres', '--', 'test', '-w', dir])
      if (t.code === 0) return dir
      lastErr = new Error(`the postgres user cannot write to ${dir}`)
    } catch (err) {
      lastErr = err
    }
    rmSync(dir, { recursive: true, force: true })
  }
  throw lastErr
}

// ---------------------------------------------------------------------------
// servers

async function startPostgres (binDir, stack) {
  const initdb = path.join(binDir, 'initdb')
  const pgCtl = path.join(binDir, 'pg_ctl')
  const psql = existsSync(path.join(binDir, 'psql')) ? path.join(binDir, 'psql') : which('psql')
  const createdb = existsSync(path.join(binDir, 'createdb')) ? path.join(binDir, 'createdb') : which('createdb')

  const dataDir = makeTempDir('idem-pg-', { forPostgres: true })
  stack.push({ kind: 'dir', dir: dataDir })
  const logFile = path.join(dataDir, 'server.log')

  const init = await run(...asPg(initdb, ['-D', dataDir, '-U', 'postgres', '--auth=trust', '-E', 'UTF8', '--locale=C.UTF-8', '--no-sync']), { timeout: 120_000 })
  if (init.code !== 0) throw fail(`initdb failed (exit ${init.code})`, init.out)

  let port
  for (let attempt = 1; ; attempt++) {
    port = await freePort()
    const opts = [
      `-p ${port}`,
      '-c listen_addresses=127.0.0.1',
      `-c unix_socket_directories=${dataDir}`,
      '-c fsync=off', '-c synchronous_commit=off', '-c full_page_writes=off',
      '-c max_connections=300'
    ].join(' ')
    const start = await run(...asPg(pgCtl, ['-D', dataDir, '-l', logFile, '-w', '-t', String(WAIT_TIMEOUT_MS / 1000), '-o', opts, 'start']), { timeout: WAIT_TIMEOUT_MS + 10_000 })
    if (start.code === 0) break
    // a port race is the usual cause; make sure nothing half-started is left, then retry
    await run(...asPg(pgCtl, ['-D', dataDir, '-m', 'immediate', '-w', 'stop']), { timeout: 15_000 })
    if (attempt >= 3) throw fail(`pg_ctl start failed (exit ${start.code})`, start.out, logFile)
    log(`pg_ctl start failed on port ${port} (attempt ${attempt}), retrying on another port`)
  }
  stack.push({ kind: 'pg', pgCtl, dataDir })

  const connArgs = ['-h', '127.0.0.1', '-p', String(port), '-U', 'postgres']
  const pgEnv = { ...process.env, PGCONNECT_TIMEOUT: '5' }
  delete pgEnv.PGPASSWORD; delete pgEnv.PGSERVICE; delete pgEnv.PGOPTIONS
  let mk
  if (psql) mk = await run(psql, [...connArgs, '-d', 'postgres', '-X', '-q', '-A', '-t', '-v', 'ON_ERROR_STOP=1', '-c', 'CREATE DATABASE idem_test'], { env: pgEnv })
  else if (createdb) mk = await run(createdb, [...connArgs, 'idem_test'], { env: pgEnv })
  else throw new Error(`neither psql nor createdb found (looked in ${binDir} and PATH); ${INSTALL_HINT}`)
  if (mk.code !== 0) throw fail(`creating database idem_test failed (exit ${mk.code})`, mk.out, logFile)

  return `postgres://postgres@127.0.0.1:${port}/idem_test`
}

async function ping (cli, port) {
  const r = await run(cli, ['-h', '127.0.0.1', '-p', String(port), 'ping'], { timeout: 5_000 })
  return r.out.includes('PONG') ? true : r.out
}

async function startRedisNode (bin, cli, stack, { port, dir, extra = [] }) {
  const logFile = path.join(dir, 'redis.log')
  const pidFile = path.join(dir, 'redis.pid')
  const r = await run(bin, [
    '--port', String(port), '--bind', '127.0.0.1',
    '--save', '', '--appendonly', 'no',
    '--dir', dir, '--daemonize', 'yes', '--pidfile', pidFile, '--logfile', logFile,
    ...extra
  ], { timeout: 15_000 })
  stack.push({ kind: 'redis', cli, port, pidFile }) // pushed even on failure: stopping is harmless
  if (r.code !== 0) throw fail(`redis-server on port ${port} failed to start (exit ${r.code})`, r.out, logFile)
  await waitFor(`redis-server on 127.0.0.1:${port} to answer PING`, async () => {
    const r = await ping(cli, port)
    if (r === true) return true
    // fail fast when the daemon already died (e.g. the port was taken meanwhile)
    let pid = 0
    try { pid = Number(readFileSync(pidFile, 'utf8').trim()) } catch {}
    let logText = ''
    try { logText = readFileSync(logFile, 'utf8') } catch {}
    if ((pid && !pidAlive(pid)) || /Failed listening on port|# FATAL|Fatal error/i.test(logText)) {
      throw fail(`redis-server on port ${port} exited during startup`, r, logFile)
    }
    return r
  }, { logFile })
}

async function startRedis (bin, cli, stack) {
  const dir = makeTempDir('idem-redis-')
  stack.push({ kind: 'dir', dir })
  for (let attempt = 1; ; attempt++) {
    const port = await freePort()
    try {
      await startRedisNode(bin, cli, stack, { port, dir })
      return `redis://127.0.0.1:${port}`
    } catch (err) {
      if (attempt >= 3) throw err
      log(`redis-server failed on port ${port} (attempt ${attempt}), retrying on another port`)
      stopEntry(stack.pop()) // the 'redis' entry startRedisNode pushed; the dir stays
    }
  }
}

async function startRedisCluster (bin, cli, stack) {
  const root = makeTempDir('idem-rcluster-')
  stack.push({ kind: 'dir', dir: root })
  let ports
  for (let attempt = 1; ; attempt++) {
    ports = await freeClusterPorts()
    const started = stack.length
    try {
      for (const port of ports) {
        const dir = path.join(root, String(port))
        mkdirSync(dir, { recursive: true })
        await startRedisNode(bin, cli, stack, {
          port,
          dir,
          extra: ['--cluster-enabled', 'yes', '--cluster-config-file', path.join(dir, 'nodes.conf'), '--cluster-node-timeout', '5000']
        })
      }
      break
    } catch (err) {
      // A port taken between the check and the bind: stop this attempt's nodes, try other ports.
      if (attempt >= 3) throw err
      log(`a Redis Cluster node failed on ports ${ports.join(', ')} (attempt ${attempt}), retrying on others`)
      while (stack.length > started) stopEntry(stack.pop())
    }
  }
  const addrs = ports.map((p) => `127.0.0.1:${p}`)
  const create = await run(cli, ['--cluster', 'create', ...addrs, '--cluster-replicas', '0', '--cluster-yes'], { timeout: 60_000 })
  if (create.code !== 0) throw fail(`redis-cli --cluster create failed (exit ${create.code})`, create.out, path.join(root, String(ports[0]), 'redis.log'))
  for (const port of ports) {
    await waitFor(`Redis Cluster node 127.0.0.1:${port} to report cluster_state:ok`, async () => {
      const r = await run(cli, ['-h', '127.0.0.1', '-p', String(port), 'cluster', 'info'], { timeout: 5_000 })
      return r.out.includes('cluster_state:ok') ? true : r.out
    }, { interval: 100, logFile: path.join(root, String(port), 'redis.log') })
  }
  return addrs.join(',')
}

// ---------------------------------------------------------------------------
// teardown (synchronous, never throws)

function pidAlive (pid) {
  try {
    const st = readFileSync(`/proc/${pid}/stat`, 'utf8')
    // zombies (state Z) are dead for our purposes: PID 1 here may not reap them
    return !/\)\s+Z\s/.test(st)
  } catch {
    try { process.kill(pid, 0); return true } catch { return false }
  }
}

function killPidFile (pidFile) {
  let pid
  try { pid = Number(readFileSync(pidFile, 'utf8').split('\n')[0].trim()) } catch { return }
  if (!pid || !pidAlive(pid)) return
  try { process.kill(pid, 'SIGTERM') } catch {}
  const deadline = Date.now() + 5_000
  while (pidAlive(pid) && Date.now() < deadline) Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 50)
  if (pidAlive(pid)) { try { process.kill(pid, 'SIGKILL') } catch {} }
}

function stopEntry (entry) {
  if (!entry) return
  try {
    if (entry.kind === 'pg') {
      const r = runSync(...asPg(entry.pgCtl, ['-D', entry.dataDir, '-m', 'fast', '-w', '-t', '30', 'stop']), { timeout: 40_000 })
      if (r.code !== 0 && existsSync(path.join(entry.dataDir, 'postmaster.pid'))) {
        runSync(...asPg(entry.pgCtl, ['-D', entry.dataDir, '-m', 'immediate', '-w', '-t', '10', 'stop']), { timeout: 15_000 })
        killPidFile(path.join(entry.dataDir, 'postmaster.pid'))
      }
    } else if (entry.kind === 'redis') {
      runSync(entry.cli, ['-h', '127.0.0.1', '-p', String(entry.port), 'shutdown', 'nosave'], { timeout: 10_000 })
      killPidFile(entry.pidFile) // no-op when the shutdown worked
    } else if (entry.kind === 'dir') {
      rmSync(entry.dir, { recursive: true, force: true, maxRetries: 3 })
    }
  } catch (err) {
    try { log(`cleanup of ${entry.kind} ${entry.dir ?? entry.port ?? entry.dataDir} failed: ${err?.message ?? err}`) } catch {}
  }
}

// ---------------------------------------------------------------------------

/**
 * @returns {Promise<{ env: Record<string,string>, stop: (() => Promise<void>) & { sync: () => void } }>}
 */
export async function startServices ({ postgres = true, redis = true, redisCluster = true } = {}) {
  const t0 = Date.now()
  const env = {}
  const stack = [] // things to undo, in start order; torn down in reverse

  let stopped = false
  const stopSync = () => {
    if (stopped) return
    stopped = true
    while (stack.length) stopEntry(stack.pop())
  }
  const stop = async () => { try { stopSync() } catch {} }
  stop.sync = () => { try { stopSync() } catch {} }

  const needPg = postgres && !process.env.DATABASE_URL
  const needRedis = redis && !process.env.REDIS_URL
  const needCluster = redisCluster && !process.env.REDIS_CLUSTER_NODES

  try {
    let pgBin = findPgBinDir()
    let { server: redisBin, cli: redisCli } = findRedis()

    const missing = []
    if (needPg && !pgBin) missing.push('postgresql')
    if ((needRedis || needCluster) && (!redisBin || !redisCli)) missing.push('redis-server', 'redis-tools')
    if (missing.length && IS_ROOT && which('apt-get')) {
      await aptInstall(missing)
      pgBin = findPgBinDir()
      ;({ server: redisBin, cli: redisCli } = findRedis())
    }
    if (needPg && !pgBin) throw new Error(`PostgreSQL server binaries (initdb, pg_ctl) not found in /usr/lib/postgresql/*/bin or PATH. ${INSTALL_HINT}`)
    if ((needRedis || needCluster) && !redisBin) throw new Error(`redis-server not found. ${INSTALL_HINT}`)
    if ((needRedis || needCluster) && !redisCli) throw new Error(`redis-cli not found (Debian: apt-get install redis-tools). ${INSTALL_HINT}`)

    if (pgBin) env.PG_BIN_DIR = pgBin
    if (redisBin) env.REDIS_SERVER_BIN = redisBin

    if (postgres) env.DATABASE_URL = needPg ? await startPostgres(pgBin, stack) : process.env.DATABASE_URL
    if (redis) env.REDIS_URL = needRedis ? await startRedis(redisBin, redisCli, stack) : process.env.REDIS_URL
    if (process.env.REDIS_CLUSTER_NODES) env.REDIS_CLUSTER_NODES = process.env.REDIS_CLUSTER_NODES
    else if (redisCluster) env.REDIS_CLUSTER_NODES = await startRedisCluster(redisBin, redisCli, stack)
  } catch (err) {
    stopSync()
    throw err
  }

  const started = [needPg && 'postgres', needRedis && 'redis', needCluster && 'redis-cluster'].filter(Boolean)
  log(started.length
    ? `started ${started.join(', ')} in ${((Date.now() - t0) / 1000).toFixed(1)} s`
    : 'using the servers from the environment; nothing started')
  return { env, stop }
}
