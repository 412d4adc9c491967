/**
 * The PostgreSQL and Redis a benchmark script runs against: the ones DATABASE_URL / REDIS_URL name,
 * else throwaway servers from scripts/services.mjs (only what is not given), stopped synchronously
 * on any exit, so ^C leaves no PostgreSQL behind.
 */

interface Services { env: Record<string, string>, stop: (() => Promise<void>) & { sync: () => void } }

export interface BenchServices {
  readonly databaseUrl: string
  readonly redisUrl: string
  /** True when the servers are throwaway ones started here (not DATABASE_URL's). */
  readonly provisioned: boolean
  /** Stops what was started here (nothing otherwise). */
  readonly stop: () => Promise<void>
}

/** `onExit` runs first at exit (a script kills its server processes there). */
export async function benchServices (onExit: () => void = () => {}): Promise<BenchServices> {
  let services: Services | null = null
  process.once('exit', () => { onExit(); services?.stop.sync() })
  process.once('SIGINT', () => process.exit(130))
  process.once('SIGTERM', () => process.exit(143))
  if (!process.env.DATABASE_URL || !process.env.REDIS_URL) {
    // Imported through a computed specifier: services.mjs is plain JS without type declarations.
    const { startServices } = await import(new URL('../scripts/services.mjs', import.meta.url).href) as {
      startServices: (options: { redis: boolean, redisCluster: boolean }) => Promise<Services>
    }
    services = await startServices({ redis: true, redisCluster: false })
  }
  const started = services
  return {
    databaseUrl: started?.env.DATABASE_URL ?? process.env.DATABASE_URL ?? '',
    redisUrl: started?.env.REDIS_URL ?? process.env.REDIS_URL ?? '',
    provisioned: started !== null,
    stop: async () => { await started?.stop() }
  }
}
