/**
 * The harness's only source of randomness: a seeded generator (sfc32), so a run's operations,
 * bodies, keys and fault schedule are the same for the same seed. What the system does with them
 * (timing, interleavings) is not reproducible; the seed narrows a failing run down to its inputs.
 */
export interface Random {
  /** A float in [0, 1). */
  (): number
  /** An integer in [min, max]. */
  int (min: number, max: number): number
  /** A float in [min, max). */
  between (min: number, max: number): number
  chance (probability: number): boolean
  pick<T> (items: readonly T[]): T
  /** 32 lowercase hex digits: a key with 128 random bits (the draft recommends UUID-grade keys). */
  hex128 (): string
  /** An independent generator for one concern (the fault schedule, the proxies), stable per label. */
  fork (label: string): Random
}

export function seededRandom (seed: number): Random {
  let a = 0x9e3779b9 ^ seed
  let b = 0x243f6a88 ^ (seed >>> 0)
  let c = 0xb7e15162
  let d = (seed * 2654435761) >>> 0
  const next = (): number => {
    a >>>= 0; b >>>= 0; c >>>= 0; d >>>= 0
    let t = (a + b) | 0
    a = b ^ (b >>> 9)
    b = (c + (c << 3)) | 0
    c = (c << 21) | (c >>> 11)
    d = (d + 1) | 0
    t = (t + d) | 0
    c = (c + t) | 0
    return (t >>> 0) / 4294967296
  }
  for (let i = 0; i < 16; i++) next()

  const random = next as Random
  random.int = (min, max) => min + Math.floor(next() * (max - min + 1))
  random.between = (min, max) => min + next() * (max - min)
  random.chance = (probability) => next() < probability
  random.pick = <T>(items: readonly T[]): T => {
    if (items.length === 0) throw new RangeError('pick() from an empty list')
    return items[Math.floor(next() * items.length)] as T
  }
  random.hex128 = () => {
    let out = ''
    for (let i = 0; i < 4; i++) out += Math.floor(next() * 4294967296).toString(16).padStart(8, '0')
    return out
  }
  random.fork = (label) => {
    let h = seed >>> 0
    for (let i = 0; i < label.length; i++) h = Math.imul(h ^ label.charCodeAt(i), 16777619) >>> 0
    return seededRandom(h)
  }
  return random
}
