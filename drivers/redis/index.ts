/**
 * The Redis pre-filter: `import { redisPrefilter } from 'fastify-idempotency/redis'`. `ioredis` is an
 * optional peer dependency, imported only through this entry point. Redis is never the source of
 * truth: see lib/core/prefilter.ts for what a pre-filter may and may not decide.
 */
// The plugin's types for Fastify (`request.idempotency`, `config.idempotency`): a file that imports
// only this entry point sees them too.
import '../../lib/fastify/types.js'
export { redisPrefilter, type PrefilterStats, type RedisPrefilter } from './prefilter.js'
export { PrefilterClosedError, PrefilterTimeoutError } from './errors.js'
export type { RedisPrefilterOptions } from './options.js'
