import { execFile } from 'node:child_process'
import { connect } from 'node:net'
import path from 'node:path'
import { fileURLToPath, pathToFileURL } from 'node:url'
import postgres from 'postgres'
import { sleep } from '../helpers/sleep.js'
import { clusterNodes } from '../helpers/redis-nodes.js'

/**
 * The harness's own PostgreSQL, Redis and 3-master Redis Cluster, and the handles that break them.
 *
 * Always a private set, started with scripts/services.mjs even when the test runner already
 * provides servers: the harness restarts, stops and flushes them, which would break the other test
 * files sharing the suite's servers (tap runs files in parallel).
 */

export interface Endpoint {
  readonly host: string
  readonly port: number
}

export interface Services {
  /** Direct (unproxied) URL, for the harness's own queries. */
  readonly databaseUrl: string
  readonly database: Endpoint
  readonly redis: RedisNode
  readonly cluster: readonly RedisNode[]
  readonly postgres: PostgresServer
  /** Synchronous and idempotent: safe from an 'exit' handler. */
  stop (): void
}

interface ServicesModule {
  startServices (options?: { postgres?: boolean, redis?: boolean, redisCluster?: boolean }): Promise<{
    env: Record<string, string | undefined>
    stop: (() => Promise<void>) & { sync: () => void }
  }>
}

const IS_ROOT = typeof process.getuid === 'function' && process.getuid() === 0
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..')

export async function startPrivateServices (): Promise<Services> {
  // Through a URL held in a variable: services.mjs is plain JS without declarations.
  const moduleUrl = pathToFileURL(path.join(root, 'scripts/services.mjs')).href
  const { startServices } = await import(moduleUrl) as ServicesModule
  const inherited = { DATABASE_URL: process.env.DATABASE_URL, REDIS_URL: process.env.REDIS_URL, REDIS_CLUSTER_NODES: process.env.REDIS_CLUSTER_NODES }
  delete process.env.DATABASE_URL
  delete process.env.REDIS_URL
  delete process.env.REDIS_CLUSTER_NODES
  let started: Awaited<ReturnType<ServicesModule['startServices']>>
  try {
    started = await startServices()
  } finally {
    for (const [name, value] of Object.entries(inherited)) if (value !== undefined) process.env[name] = value
  }
  const stop = (): void => started.stop.sync()
  try {
    const env = started.env
    const databaseUrl = required(env, 'DATABASE_URL')
    const url = new URL(databaseUrl)
    const database = { host: url.hostname, port: Number(url.port) }
    const cli = path.join(path.dirname(required(env, 'REDIS_SERVER_BIN')), 'redis-cli')
    const server = required(env, 'REDIS_SERVER_BIN')
    const redisUrl = new URL(required(env, 'REDIS_URL'))
    const redis = await RedisNode.describe(server, cli, { host: redisUrl.hostname, port: Number(redisUrl.port) }, false)
    const cluster: RedisNode[] = []
    for (const node of clusterNodes(required(env, 'REDIS_CLUSTER_NODES'))) {
      cluster.push(await RedisNode.describe(server, cli, node, true))
    }
    const pg = await PostgresServer.describe(required(env, 'PG_BIN_DIR'), databaseUrl, database)
    return { databaseUrl, database, redis, cluster, postgres: pg, stop }
  } catch (err) {
    stop()
    throw err
  }
}

function required (env: Record<string, string | undefined>, name: string): string {
  const value = env[name]
  if (value === undefined || value === '') throw new Error(`chaos: scripts/services.mjs did not provide ${name}`)
  return value
}

interface RunResult { readonly code: number, readonly out: string }

function run (command: string, args: readonly string[], timeoutMs = 60_000): Promise<RunResult> {
  return new Promise((resolve) => {
    execFile(command, args, { timeout: timeoutMs, encoding: 'utf8' }, (err, stdout, stderr) => {
      const code = err === null ? 0 : typeof (err as { code?: unknown }).code === 'number' ? (err as { code: number }).code : 1
      resolve({ code, out: `${stdout}${stderr}` })
    })
  })
}

/** initdb and pg_ctl refuse to run as root: as the `postgres` user then, as services.mjs does. */
function runAsPostgres (command: string, args: readonly string[], timeoutMs?: number): Promise<RunResult> {
  return IS_ROOT ? run('runuser', ['-u', 'postgres', '--', command, ...args], timeoutMs) : run(command, args, timeoutMs)
}

/** True once something accepts TCP connections on `endpoint`. */
export function reachable (endpoint: Endpoint, timeoutMs = 500): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = connect(endpoint)
    const done = (ok: boolean): void => { socket.destroy(); resolve(ok) }
    socket.setTimeout(timeoutMs, () => done(false))
    socket.once('connect', () => done(true))
    socket.once('error', () => done(false))
  })
}

export class PostgresServer {
  private constructor (
    private readonly pgCtl: string,
    readonly dataDir: string,
    readonly endpoint: Endpoint,
    private readonly admin: postgres.Sql
  ) {}

  static async describe (binDir: string, url: string, endpoint: Endpoint): Promise<PostgresServer> {
    const admin = postgres(url, { max: 2, onnotice: () => {}, connect_timeout: 3, fetch_types: false, connection: { application_name: 'chaos-admin' } })
    const [row] = await admin<Array<{ data_directory: string }>>`SELECT current_setting('data_directory') AS data_directory`
    if (row === undefined) throw new Error('chaos: could not read the data directory')
    return new PostgresServer(path.join(binDir, 'pg_ctl'), row.data_directory, endpoint, admin)
  }

  /** The harness's own connection (direct, never proxied, never terminated by a fault). */
  get sql (): postgres.Sql { return this.admin }

  /**
   * `fast` is a clean shutdown (checkpoint); `immediate` is a crash: every backend dies at once and
   * the next start runs crash recovery. The apps set synchronous_commit=on on their sessions, so a
   * COMMIT they saw succeed survives it.
   */
  async stop (mode: 'fast' | 'immediate'): Promise<void> {
    const result = await runAsPostgres(this.pgCtl, ['-D', this.dataDir, '-m', mode, '-w', '-t', '30', 'stop'], 40_000)
    if (result.code !== 0) throw new Error(`pg_ctl stop -m ${mode} failed (${result.code}): ${result.out.trim()}`)
  }

  /** The options scripts/services.mjs starts it with (no persistence guarantees beyond the OS cache). */
  async start (): Promise<void> {
    const options = [
      `-p ${this.endpoint.port}`, '-c listen_addresses=127.0.0.1', `-c unix_socket_directories=${this.dataDir}`,
      '-c fsync=off', '-c synchronous_commit=off', '-c full_page_writes=off', '-c max_connections=300'
    ].join(' ')
    const result = await runAsPostgres(this.pgCtl, ['-D', this.dataDir, '-l', path.join(this.dataDir, 'server.log'), '-w', '-t', '60', '-o', options, 'start'], 70_000)
    if (result.code !== 0) throw new Error(`pg_ctl start failed (${result.code}): ${result.out.trim()}`)
  }

  /** Terminates every backend whose application_name starts with `prefix`; returns how many. */
  async terminate (prefix: string): Promise<number> {
    // MATERIALIZED: the filter runs first, whatever order the planner would evaluate the quals in.
    const rows = await this.admin<Array<{ pid: number }>>`
      WITH targets AS MATERIALIZED (
        SELECT pid FROM pg_stat_activity WHERE application_name LIKE ${prefix + '%'} AND pid <> pg_backend_pid()
      )
      SELECT pid FROM targets WHERE pg_terminate_backend(pid)`
    return rows.length
  }

  /** Runs `fn` on the admin connection, retrying while the server restarts. */
  async query<T> (fn: (sql: postgres.Sql) => Promise<T>, timeoutMs = 30_000): Promise<T> {
    const deadline = Date.now() + timeoutMs
    for (;;) {
      try {
        return await fn(this.admin)
      } catch (err) {
        if (Date.now() > deadline) throw err
        await sleep(200)
      }
    }
  }

  async close (): Promise<void> {
    await this.admin.end({ timeout: 1 })
  }
}

export class RedisNode {
  private constructor (
    private readonly server: string,
    private readonly cli: string,
    readonly endpoint: Endpoint,
    readonly clustered: boolean,
    private readonly dir: string,
    private readonly pidFile: string,
    private readonly logFile: string,
    private readonly clusterConfigFile: string
  ) {}

  static async describe (server: string, cli: string, endpoint: Endpoint, clustered: boolean): Promise<RedisNode> {
    const get = async (name: string): Promise<string> => {
      const result = await run(cli, ['-h', endpoint.host, '-p', String(endpoint.port), 'config', 'get', name])
      const value = result.out.trim().split('\n')[1]
      if (result.code !== 0 || value === undefined) throw new Error(`chaos: redis-cli config get ${name} failed: ${result.out}`)
      return value
    }
    const dir = await get('dir')
    const clusterConfigFile = clustered ? path.resolve(dir, await get('cluster-config-file')) : ''
    return new RedisNode(server, cli, endpoint, clustered, dir, await get('pidfile'), path.resolve(dir, await get('logfile')), clusterConfigFile)
  }

  get address (): string { return `${this.endpoint.host}:${this.endpoint.port}` }

  private command (...args: string[]): Promise<RunResult> {
    return run(this.cli, ['-h', this.endpoint.host, '-p', String(this.endpoint.port), ...args], 10_000)
  }

  async flushAll (): Promise<boolean> {
    const result = await this.command('flushall')
    return result.code === 0 && result.out.includes('OK')
  }

  async stop (): Promise<void> {
    await this.command('shutdown', 'nosave')
    const deadline = Date.now() + 10_000
    while (await reachable(this.endpoint)) {
      if (Date.now() > deadline) throw new Error(`chaos: redis ${this.address} did not stop`)
      await sleep(50)
    }
  }

  /** Starts it again as scripts/services.mjs did: same port, directory, pid file and (cluster) node config. */
  async start (): Promise<void> {
    const args = [
      '--port', String(this.endpoint.port), '--bind', this.endpoint.host, '--save', '', '--appendonly', 'no',
      '--dir', this.dir, '--daemonize', 'yes', '--pidfile', this.pidFile, '--logfile', this.logFile
    ]
    if (this.clustered) args.push('--cluster-enabled', 'yes', '--cluster-config-file', this.clusterConfigFile, '--cluster-node-timeout', '5000')
    const result = await run(this.server, args, 15_000)
    if (result.code !== 0) throw new Error(`chaos: redis-server ${this.address} failed to start: ${result.out}`)
    const deadline = Date.now() + 20_000
    for (;;) {
      const ping = await this.command(...(this.clustered ? ['cluster', 'info'] : ['ping']))
      if (this.clustered ? ping.out.includes('cluster_state:ok') : ping.out.includes('PONG')) return
      if (Date.now() > deadline) throw new Error(`chaos: redis ${this.address} did not come back: ${ping.out}`)
      await sleep(100)
    }
  }
}
