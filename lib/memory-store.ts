import { memoryStore as createMemoryStore, type MemoryStore, type MemoryStoreOptions } from '../drivers/memory.js'

/** Stores made by the exported `memoryStore`, so the plugin can warn where one cannot be shared. */
const made = new WeakSet<object>()

/**
 * The embedded default: one process, nothing to install. Every operation runs synchronously inside
 * one call, so claims are atomic with respect to each other within the process; it is not shared
 * between processes (use the Postgres driver for several instances).
 */
export function memoryStore (options?: MemoryStoreOptions): MemoryStore {
  const store = createMemoryStore(options)
  made.add(store)
  return store
}

export function isMemoryStore (store: unknown): boolean {
  return typeof store === 'object' && store !== null && made.has(store)
}
