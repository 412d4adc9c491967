import { readFileSync } from 'node:fs'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import pg from 'pg'
import postgres from 'postgres'

/**
 * The PostgreSQL client the chaos processes (the app instances and the reconciler worker) run the
 * store on, chosen by `--client=` (CHAOS_PG_CLIENT in their environment): postgres.js or a
 * node-postgres Pool, each with the same pool size, connect timeout, application_name (the
 * pg-terminate fault finds the apps' backends by it) and session settings. In node-postgres mode
 * the process holds no postgres.js client at all, so a process death there is node-postgres's
 * or the plugin's, never postgres.js's.
 *
 * The harness's own connections (services.ts, the probe, collect.ts, the operator store) stay on
 * postgres.js: they are never faulted, and they observe rather than run the store under test.
 */

export const PG_CLIENTS = ['postgres', 'pg'] as const
export type PgClient = typeof PG_CLIENTS[number]

/** For the summary and messages. */
export const CLIENT_LABELS: Readonly<Record<PgClient, string>> = { postgres: 'postgres.js', pg: 'node-postgres' }

/** `node-postgres 8.23.1`: the library as installed, for the summary (postgres.js exports no package.json to import). */
export function clientVersion (client: PgClient): string {
  const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..')
  const { version } = JSON.parse(readFileSync(path.join(root, 'node_modules', client, 'package.json'), 'utf8')) as { version: string }
  return `${CLIENT_LABELS[client]} ${version}`
}

export function pgClientFromEnv (value: string | undefined): PgClient {
  const client = value === undefined || value === '' ? 'postgres' : value
  if (!(PG_CLIENTS as readonly string[]).includes(client)) throw new Error(`chaos: CHAOS_PG_CLIENT must be ${PG_CLIENTS.join(' or ')}; received ${client}`)
  return client as PgClient
}

export interface DatabaseSettings {
  readonly url: string
  readonly max: number
  readonly applicationName: string
}

export interface Database {
  readonly client: PgClient
  /** What `postgresStore` takes: `{ sql }` or `{ pool }`. */
  readonly connection: { readonly sql: postgres.Sql } | { readonly pool: pg.Pool }
  /** One statement with `$n` parameters, outside any transaction (a planted bug's SQL); the rows it affected. */
  run (text: string, values: ReadonlyArray<string | number>): Promise<number>
  /** Bounded: a client whose connection died mid-query may never finish ending. */
  end (): Promise<void>
}

export function openDatabase (client: PgClient, settings: DatabaseSettings): Database {
  return client === 'pg' ? nodePostgres(settings) : postgresJs(settings)
}

function postgresJs ({ url, max, applicationName }: DatabaseSettings): Database {
  const sql = postgres(url, {
    max,
    connect_timeout: 3,
    onnotice: () => {},
    // postgres.js 3.4.9 fetches array types as the first query of every connection and drops that
    // promise: a connection reset meanwhile is an unhandled rejection that kills the process
    // (porsager/postgres#1192). The plugin binds no arrays, so nothing is lost by not fetching.
    fetch_types: false,
    // synchronous_commit on for this session: a COMMIT the app saw succeed survives a server crash
    // (the throwaway server runs with it off).
    connection: { application_name: applicationName, synchronous_commit: 'on' }
  })
  return {
    client: 'postgres',
    connection: { sql },
    run: async (text, values) => (await sql.unsafe(text, values as never[])).count,
    // Bounded: postgres.js 3.4.9's end() can hang after a connection died mid-query (porsager/postgres#1097).
    end: () => sql.end({ timeout: 1 })
  }
}

function nodePostgres ({ url, max, applicationName }: DatabaseSettings): Database {
  // pg's own defaults otherwise (idle clients closed after 10 s, no query timeout), as an
  // application would run it. No 'error' listener here: the store adds its own when the pool has
  // none (drivers/postgres/options.ts, `pool`), and that is part of what the run puts to the test.
  const pool = new pg.Pool({
    connectionString: url,
    max,
    connectionTimeoutMillis: 3_000,
    application_name: applicationName,
    // The startup parameter postgres.js sends as `connection`: see postgresJs.
    options: '-c synchronous_commit=on'
  })
  return {
    client: 'pg',
    connection: { pool },
    run: async (text, values) => (await pool.query(text, values as unknown[])).rowCount ?? 0,
    end: () => Promise.race([pool.end(), new Promise<void>((resolve) => setTimeout(resolve, 1_000).unref())])
  }
}
