import type { IdempotencyPrefilter, PrefilterHit } from '../../lib/core/prefilter.js'
import type { Fingerprint, RecordId, StoredResponse } from '../../lib/core/store.js'
import { now } from './clock.js'
import type { Network } from './network.js'

/*
 * The pre-filter the simulated instances share (Redis in production): completed copies and
 * in-flight markers with an expiry, each marker owned by the request that wrote it (the RecordId
 * object the core passes for all of a request's calls), behind the same simulated network as the
 * store.
 */

interface Entry {
  readonly state: 'in_progress' | 'completed'
  readonly fingerprint: Fingerprint
  readonly response: StoredResponse | null
  readonly owner: RecordId | null
  readonly until: number
}

export class PrefilterModel {
  readonly #entries = new Map<string, Entry>()

  entry (key: string): Entry | undefined {
    const entry = this.#entries.get(key)
    if (entry !== undefined && entry.until <= now()) {
      this.#entries.delete(key)
      return undefined
    }
    return entry
  }

  set (key: string, entry: Entry): void { this.#entries.set(key, entry) }
  delete (key: string): void { this.#entries.delete(key) }
}

function hitOf (entry: Entry | undefined, caller: RecordId): PrefilterHit | null {
  if (entry === undefined || entry.owner === caller) return null
  return entry.state === 'completed'
    ? { state: 'completed', fingerprint: entry.fingerprint, response: entry.response as StoredResponse }
    : { state: 'in_progress', fingerprint: entry.fingerprint }
}

const describeHit = (hit: PrefilterHit | null): string => hit === null ? 'miss' : hit.state

export function prefilterOn (model: PrefilterModel, network: Network, requestOf: () => number | null): IdempotencyPrefilter {
  return {
    lookup: (id) => network.call('p.lookup', id.key, requestOf(), () => hitOf(model.entry(id.key), id), describeHit),
    lookupOrMark: (id, fingerprint, ttlMs) => network.call('p.lookupOrMark', id.key, requestOf(), () => {
      const entry = model.entry(id.key)
      if (entry !== undefined && entry.owner !== id) return { hit: hitOf(entry, id), marked: false }
      if (entry === undefined) model.set(id.key, { state: 'in_progress', fingerprint, response: null, owner: id, until: now() + ttlMs })
      return { hit: null, marked: true }
    }, (looked) => looked.marked ? 'marked' : describeHit(looked.hit)),
    markInFlight: (id, fingerprint, ttlMs) => network.call('p.mark', id.key, requestOf(), () => {
      if (model.entry(id.key)?.state !== 'completed') model.set(id.key, { state: 'in_progress', fingerprint, response: null, owner: id, until: now() + ttlMs })
    }, () => 'ok'),
    clearInFlight: (id) => network.call('p.clear', id.key, requestOf(), () => {
      const entry = model.entry(id.key)
      if (entry?.state === 'in_progress' && entry.owner === id) model.delete(id.key)
    }, () => 'ok'),
    remember: (id, fingerprint, response, ttlMs) => network.call('p.remember', id.key, requestOf(), () => {
      model.set(id.key, { state: 'completed', fingerprint, response, owner: null, until: now() + ttlMs })
    }, () => 'ok'),
    close: async () => {}
  }
}
