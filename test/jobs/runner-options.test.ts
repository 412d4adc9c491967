import t from 'tap'
import { idempotencyRunner, InvalidOptionError, memoryStore, type RunnerOptions } from '../../lib/index.js'

/*
 * idempotencyRunner()'s own options, validated once when the runner is built: each refusal names
 * the option (as the runner's, not the plugin's) and describes the value without showing it.
 */

t.test('a runner\'s options are refused by name', async (t) => {
  const store = memoryStore({ purgeInterval: 0 })
  t.teardown(() => store.close())
  const cases: Array<[unknown, RegExp]> = [
    [undefined, /idempotencyRunner\(\) options must be an object with a store/],
    [{}, /idempotencyRunner\(\) option "store" must be an IdempotencyStore/],
    [{ store: { claim () {} } }, /idempotencyRunner\(\) option "store" must be an IdempotencyStore \(missing complete, release/],
    [{ store, prefilter: {} }, /idempotencyRunner\(\) option "prefilter" must be an IdempotencyPrefilter/],
    [{ store, leaseMs: 1000 }, /idempotencyRunner\(\) option "leaseMs" must be one of store, prefilter, ttl, lease/],
    [{ store, lease: 0 }, /idempotencyRunner\(\) option "lease"/],
    [{ store, ttl: 1000, lease: 2000 }, /idempotencyRunner\(\) option "lease"/],
    [{ store, transaction: true }, /idempotencyRunner\(\) option "transaction" must be false unless the store supports transactions/],
    [{ store, log: console.log }, /idempotencyRunner\(\) option "log" must be a logger with debug, info, warn, error/],
    [{ store, retryAfter: -1 }, /idempotencyRunner\(\) option "retryAfter"/],
    [{ store, metrics: {} }, /option "metrics"/]
  ]
  for (const [options, message] of cases) {
    let err: unknown = null
    try {
      idempotencyRunner(options as RunnerOptions)
    } catch (caught) {
      err = caught
    }
    t.ok(err instanceof InvalidOptionError, `refused: ${String(err)}`)
    t.match(String((err as Error | null)?.message), message)
  }
})

t.test('a runner with a logger logs its decisions there, with the key truncated', async (t) => {
  const lines: Array<{ level: string, obj: Record<string, any>, msg: string | undefined }> = []
  const at = (level: string) => (obj: object, msg?: string): void => { lines.push({ level, obj: obj as Record<string, any>, msg }) }
  const runner = idempotencyRunner({ store: memoryStore({ purgeInterval: 0 }), log: { debug: at('debug'), info: at('info'), warn: at('warn'), error: at('error') } })
  t.teardown(() => runner.close())
  await runner.run({ key: 'a-long-job-key-0001', operation: 'op' }, async () => 1)
  await runner.run({ key: 'a-long-job-key-0001', operation: 'op', payload: 2 }, async () => 1).catch(() => {})
  t.same(lines.map((line) => [line.level, line.obj.idempotency?.outcome, line.obj.idempotency?.key]), [
    ['debug', 'executed', 'a-long-j…'],
    ['debug', 'recorded', 'a-long-j…'],
    ['info', 'mismatch', 'a-long-j…']
  ])
})
