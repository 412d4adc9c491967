/**
 * Open addressing over an Int32Array of ids, shared by the memory store's two indexes (memory-table.ts
 * for completed records, memory-pending.ts for records in progress): linear probing from a hash's
 * home slot, and backward-shift deletion, so that no tombstones pile up under churn. An index is at
 * most half full, so runs stay short. `hashes[id * stride + offset]` is the hash of `id`.
 */

/** No id: a free slot, or a lookup that found nothing. */
export const NONE = -1

/** The first free slot from `hash`'s home. */
export function freeSlot (index: Int32Array, mask: number, hash: number): number {
  let slot = hash & mask
  while (index[slot] !== NONE) slot = (slot + 1) & mask
  return slot
}

/** The slot holding `id`, whose hash is `hash` (it must be indexed). */
export function slotOf (index: Int32Array, mask: number, id: number, hash: number): number {
  let slot = hash & mask
  while (index[slot] !== id) slot = (slot + 1) & mask
  return slot
}

/**
 * Takes `id` out of the index. The ids after its slot, up to the next free one, move back into the
 * hole when their home is not between the two, so every id stays reachable from its home with no
 * free slot on the way.
 */
export function unindex (index: Int32Array, mask: number, id: number, hash: number, hashes: Int32Array, stride: number, offset: number): void {
  let hole = slotOf(index, mask, id, hash)
  for (let slot = (hole + 1) & mask; ; slot = (slot + 1) & mask) {
    const other = index[slot] as number
    if (other === NONE) break
    const home = (hashes[other * stride + offset] as number) & mask
    // Its distance from home, against the hole's distance: it may move back unless home is after the hole.
    if (((slot - home) & mask) >= ((slot - hole) & mask)) {
      index[hole] = other
      hole = slot
    }
  }
  index[hole] = NONE
}
