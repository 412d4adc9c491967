import Fastify, { type FastifyInstance, type FastifyServerOptions } from 'fastify'
import type { Test } from 'tap'
import idempotency, { memoryStore, type IdempotencyOptions, type MemoryStoreOptions } from '../../lib/index.js'
import { sleep } from './sleep.js'

/** A clock tests move by hand, for TTL and lease tests. */
export interface ManualClock {
  readonly now: () => number
  advance: (ms: number) => void
}

export function manualClock (start = 1_700_000_000_000): ManualClock {
  let at = start
  return { now: () => at, advance: (ms) => { at += ms } }
}

export interface BuildOptions {
  readonly plugin?: IdempotencyOptions
  readonly memory?: MemoryStoreOptions
  readonly fastify?: FastifyServerOptions
}

/**
 * A fresh Fastify instance with the plugin registered (memory store unless `plugin.store` is given,
 * one scope `test` unless `plugin.scope` is given), closed when the test ends.
 */
export async function buildApp (t: Test, options: BuildOptions = {}): Promise<FastifyInstance> {
  const app = Fastify(options.fastify)
  t.teardown(() => app.close())
  await app.register(idempotency, {
    scope: () => 'test',
    store: memoryStore({ purgeInterval: 0, ...options.memory }),
    ...options.plugin
  })
  return app
}

/** A deferred promise, to hold a handler in flight until the test lets it go. */
export function deferred<T = void> (): { promise: Promise<T>, resolve: (value: T) => void, reject: (err: unknown) => void } {
  let resolve!: (value: T) => void
  let reject!: (err: unknown) => void
  const promise = new Promise<T>((_resolve, _reject) => { resolve = _resolve; reject = _reject })
  return { promise, resolve, reject }
}

/** Polls until `check` holds (every 10 ms, at most `ms`); returns whether it did. A bound, not a speed assertion. */
export async function eventually (check: () => Promise<boolean> | boolean, ms = 3000): Promise<boolean> {
  const until = Date.now() + ms
  for (;;) {
    if (await check()) return true
    if (Date.now() > until) return false
    await sleep(10)
  }
}

/** Header object with a quoted (sf-string) key and a JSON content type. */
export function keyed (key: string, extra: Record<string, string> = {}): Record<string, string> {
  return { 'idempotency-key': `"${key}"`, 'content-type': 'application/json', ...extra }
}

export const PROBLEM_TYPE = (kind: string): string => `tag:fastify-idempotency,2026:${kind}`
