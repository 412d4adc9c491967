import path from 'node:path'
import { fileURLToPath } from 'node:url'
import t from 'tap'
import ts from 'typescript'

/*
 * The public surface of every entry point, values and types, by name: a name that disappears or
 * appears is a change users see, so it changes here (and in CHANGELOG.md) on purpose, never by a
 * refactoring that moved a file.
 */

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..')

const PUBLIC: Readonly<Record<string, readonly string[]>> = {
  'lib/index.ts': [
    'ClaimAcquired', 'ClaimCompleted', 'ClaimInProgress', 'ClaimRequest', 'ClaimResult', 'DECISION_CHANNEL', 'DEFAULT_REPLAY_HEADERS', 'DecisionEvent',
    'EarlierRoutesPolicy', 'EmptyScopeError', 'EncryptionKey', 'EncryptionOptions', 'Fingerprint', 'FingerprintFunction', 'FingerprintOption',
    'IdempotencyContext', 'IdempotencyKeyStatus', 'IdempotencyOptions', 'IdempotencyPrefilter', 'IdempotencyRunner', 'IdempotencyStore',
    'IdempotentOperation', 'InTransactionClaimRequest', 'InspectedRecord', 'InvalidOptionError', 'KeyFormat', 'KeyFunction', 'KeyReusedError', 'Lease', 'LeaseLostError',
    'MemoryStore', 'MemoryStoreFullError', 'MemoryStoreOptions', 'MemoryStoreUsage', 'MeterLike', 'OperationInProgressError', 'OutboxEntry',
    'Outcome', 'PrefilterHit', 'ProblemKind', 'ProfileName', 'RebuildFunction', 'RebuiltResponse', 'ReconcileOptions', 'ReconcileReport',
    'Reconciler', 'ReconcilerOptions', 'RecordId', 'RecordRule', 'RecoveryTools', 'Resolution', 'ResolvedResponse', 'RolledBackError',
    'RouteIdempotencyOptions', 'RunOptions', 'RunResult', 'RunnerOptions', 'ScopeFunction', 'SettlementHandlers', 'StandaloneRunner', 'StatusRouteOptions',
    'StepOptions', 'StepResults', 'StoreNotReadyError', 'StoreTimeoutError', 'StoreUnavailableError', 'StoredRecord', 'StoredResponse',
    'StuckRecord', 'TransactionEndedError', 'UnprotectedRoutesError', 'default', 'fastifyIdempotency', 'idempotencyRunner', 'memoryStore',
    'settlementDigest'
  ],
  'drivers/postgres/index.ts': [
    'AtomicTransaction', 'AtomicTransactionTypes', 'BackgroundTask', 'DeliveryReport', 'NodePostgresPoolLike',
    'OutboxMessage', 'OutboxOptions', 'PostgresClient', 'PostgresStore', 'PostgresStoreOptions', 'TableOptions', 'migrate', 'postgresStore'
  ],
  'drivers/redis/index.ts': ['PrefilterClosedError', 'PrefilterStats', 'PrefilterTimeoutError', 'RedisPrefilter', 'RedisPrefilterOptions', 'redisPrefilter'],
  'client/index.ts': [
    'BackoffOptions', 'FetchLike', 'IdempotentClient', 'IdempotentClientOptions', 'IdempotentResponse', 'InvalidOptionError', 'JsonValue', 'NoAnswerError',
    'ProblemDetails', 'RedirectMode', 'RequestBody', 'RequestOptions', 'ResponseTooLargeError', 'Sleep', 'createIdempotentClient'
  ],
  'conformance/index.ts': ['ConformanceOptions', 'ConformanceTest', 'runConformance']
}

t.test('every entry point exports exactly its public names', async (t) => {
  const files = Object.keys(PUBLIC).map((file) => path.join(ROOT, file))
  const program = ts.createProgram(files, {
    module: ts.ModuleKind.NodeNext, moduleResolution: ts.ModuleResolutionKind.NodeNext, target: ts.ScriptTarget.ES2022, strict: true, skipLibCheck: true, noEmit: true
  })
  const checker = program.getTypeChecker()
  for (const [file, expected] of Object.entries(PUBLIC)) {
    const source = program.getSourceFile(path.join(ROOT, file))
    const module = source === undefined ? undefined : checker.getSymbolAtLocation(source)
    t.ok(module, `${file} is a module`)
    if (module === undefined) continue
    const names = checker.getExportsOfModule(module).map((symbol) => symbol.name).sort()
    t.same(names, [...expected].sort(), `${file}: added ${JSON.stringify(names.filter((n) => !expected.includes(n)))}, missing ${JSON.stringify(expected.filter((n) => !names.includes(n)))}`)
  }
})
