import type { Sql } from 'postgres'

/**
 * Whether a client's backends are waiting on a lock: the probe the Postgres tests use to know that
 * a statement is blocked (on a row another transaction holds) before they act on it.
 *
 * On plain PostgreSQL the wait shows in `pg_stat_activity`, on the backend that carries the client's
 * application_name. On Citus the blocked statement runs on a WORKER, in a backend of Citus's own
 * (application_name `citus_internal gpid=…`), so the coordinator's `pg_stat_activity` shows the
 * client's backend merely busy. `citus_stat_activity` shows the backends of every
 * node, each with the `global_pid` of the coordinator backend it works for: the client's backends
 * are found by name, then any backend, on any node, working for them that waits on a lock.
 */
export type ActivitySource =
  | { readonly kind: 'postgres' }
  /** `schema`.`view` has the columns of Citus's `citus_stat_activity` (global_pid, is_worker_query, then pg_stat_activity's). */
  | { readonly kind: 'citus', readonly schema: string, readonly view: string }

/** citus_stat_activity when the citus extension is installed in this database, pg_stat_activity otherwise. */
export async function activitySource (sql: Sql<any>): Promise<ActivitySource> {
  const citus = await sql`SELECT 1 FROM pg_extension WHERE extname = 'citus'`
  return citus.length > 0 ? { kind: 'citus', schema: 'pg_catalog', view: 'citus_stat_activity' } : { kind: 'postgres' }
}

/** True while a backend of `applicationName` (or, on Citus, one working for it) waits on a lock. */
export async function waitingOnLock (sql: Sql<any>, source: ActivitySource, applicationName: string): Promise<boolean> {
  if (source.kind === 'postgres') {
    return (await sql`
      SELECT 1 FROM pg_stat_activity WHERE application_name = ${applicationName} AND wait_event_type = 'Lock'`).length > 0
  }
  return (await sql`
    SELECT 1 FROM ${sql(source.schema)}.${sql(source.view)} AS node
    WHERE node.wait_event_type = 'Lock' AND node.global_pid IN (
      SELECT client.global_pid FROM ${sql(source.schema)}.${sql(source.view)} AS client
      WHERE client.application_name = ${applicationName} AND NOT client.is_worker_query)`).length > 0
}

/** A probe bound to one database: detects Citus once, then answers `waitingOnLock` for a name. */
export async function lockWaitProbe (sql: Sql<any>): Promise<(applicationName: string) => Promise<boolean>> {
  const source = await activitySource(sql)
  return (applicationName) => waitingOnLock(sql, source, applicationName)
}
