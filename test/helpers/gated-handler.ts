/**
 * A route handler that runs until the test lets it go: `finish()` answers `{ run }` (its run's
 * number), `finish(true)` throws (the key is released). `finish` lets the run in flight go.
 */
export function gatedHandler (): { readonly handler: () => Promise<{ run: number }>, readonly runs: () => number, finish (fail?: boolean): void } {
  let runs = 0
  let finish: (fail?: boolean) => void = () => {}
  return {
    async handler () {
      const run = ++runs
      const failed = await new Promise<boolean>((resolve) => { finish = (fail = false) => { resolve(fail) } })
      if (failed) throw new Error('declined')
      return { run }
    },
    runs: () => runs,
    finish: (fail) => { finish(fail) }
  }
}
