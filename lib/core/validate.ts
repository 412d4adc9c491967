import { InvalidOptionError } from './errors.js'

/** setTimeout's and setInterval's ceiling: a longer delay fires at once. */
export const MAX_TIMER_MS = 2_147_483_647

/**
 * An integer option from `min` to `max` (`fallback` when absent), or an InvalidOptionError naming
 * the option and the value received. Shared by the plugin's options and every driver's.
 */
export function integerOption (name: string, value: unknown, fallback: number, min: number, max: number, unit?: string): number {
  if (value === undefined) return fallback
  if (typeof value !== 'number' || !Number.isInteger(value) || value < min || value > max) {
    throw new InvalidOptionError(name, `an integer${unit === undefined ? '' : ` number of ${unit}`} from ${min} to ${max}`, value)
  }
  return value
}

/** An optional callback option: null when absent, else a function, or an InvalidOptionError naming it. */
export function callbackOption<T> (name: string, value: T | undefined): T | null {
  if (value === undefined) return null
  if (typeof value !== 'function') throw new InvalidOptionError(name, 'a function', value)
  return value
}

/** An optional boolean option (`fallback` when absent), or an InvalidOptionError naming it and the value. */
export function booleanOption (name: string, value: unknown, fallback: boolean): boolean {
  if (value === undefined) return fallback
  if (typeof value !== 'boolean') throw new InvalidOptionError(name, 'true or false', value)
  return value
}

/** Which of `methods` `value` lacks (all of them when it is not an object): what an interface option is checked by. */
export function missingMethods (value: unknown, methods: readonly string[]): string[] {
  if (typeof value !== 'object' || value === null) return [...methods]
  return methods.filter((method) => typeof (value as Record<string, unknown>)[method] !== 'function')
}
