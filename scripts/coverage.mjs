// The coverage report and gate of the package's own code, after a whole-suite `tap` run:
//
//   node scripts/coverage.mjs
//
// tap records V8 coverage of lib/, drivers/ and client/ (.taprc, scripts/coverage-map.mjs) in
// .tap/coverage, from the test processes and from the processes they spawn. This reports it:
// c8's text table of the files not fully covered (with their uncovered lines), the json-summary
// in .tap/report/coverage-summary.json, and lines, branches and functions per folder. It exits 1
// when lib/, drivers/ or client/ is below 95% of lines or of branches, when a file of theirs
// holding runtime code was never loaded by a test (c8 leaves such a file out of the report
// instead of counting it as uncovered), or when there is no coverage at all.
//
// Why not tap's own report: c8 adds up the V8 counts of every process per file *before*
// mapping them back to the TypeScript source, and the same file is not the same JavaScript in
// every process (tap's TypeScript loader and tsx, or two tsx versions, build it differently). Mixed,
// the byte ranges of one build land on the other's and
// those files come out as one line. So each build of a file is reported under a name of its
// own here; c8 maps each through its own source map and merges the results by source file.
// (`tap report` reads the same data the mixed way: use this script instead.)

import { createHash } from 'node:crypto'
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath, pathToFileURL } from 'node:url'
import { COVERED } from './coverage-map.mjs'

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')
const FOLDERS = ['lib', 'drivers', 'client']
// Rows of the per-folder table: the gated folders, and the drivers' own folders under drivers/.
const ROWS = ['lib/', 'drivers/', 'drivers/postgres/', 'drivers/redis/', 'client/']
const METRICS = ['lines', 'branches', 'functions']
const MINIMUM = { lines: 95, branches: 95 }

/**
 * A copy of tap's coverage data in which each distinct build of a file (told apart by its source
 * map) has a name of its own, `lib/fastify/claim.ts` becoming `lib/fastify/claim.ts~<hash>.js`: c8 then merges
 * the counts of one build only, and the builds' results after mapping them to the source.
 */
function separateBuilds (from, to) {
  let processes = 0
  for (const name of readdirSync(from)) {
    let cov
    try { cov = JSON.parse(readFileSync(path.join(from, name), 'utf8')) } catch { continue }
    if (!Array.isArray(cov.result)) continue
    const maps = cov['source-map-cache'] ?? {}
    const renamed = {}
    for (const script of cov.result) {
      const map = maps[script.url]
      if (!map?.data?.mappings || !script.url.startsWith('file:')) continue
      const build = createHash('sha256').update(map.data.mappings).digest('hex').slice(0, 12)
      const url = pathToFileURL(`${fileURLToPath(script.url)}~${build}.js`).href
      renamed[url] = map
      script.url = url
    }
    cov['source-map-cache'] = renamed
    writeFileSync(path.join(to, name), JSON.stringify(cov))
    processes++
  }
  return processes
}

/** c8's report over the separated data: prints the text table, writes the json-summary, returns it. */
async function c8Report (data) {
  // c8 is tap's own dependency (@tapjs/run), resolved from there
  const requireFromTap = createRequire(createRequire(path.join(root, 'package.json')).resolve('@tapjs/run/package.json'))
  const report = requireFromTap('c8/lib/report.js')({
    include: COVERED,
    excludeAfterRemap: true,
    excludeNodeModules: true,
    reporter: ['text', 'json-summary'],
    reportsDirectory: path.join(root, '.tap', 'report'),
    tempDirectory: data,
    skipFull: true
  })
  await report.run()
  return JSON.parse(readFileSync(path.join(root, '.tap', 'report', 'coverage-summary.json'), 'utf8'))
}

function sourceFiles (dir) {
  const out = []
  for (const entry of readdirSync(path.join(root, dir), { withFileTypes: true })) {
    const rel = `${dir}/${entry.name}`
    if (entry.isDirectory()) out.push(...sourceFiles(rel))
    else if (entry.name.endsWith('.ts') && !entry.name.endsWith('.d.ts')) out.push(rel)
  }
  return out
}

/** A module of types only compiles to nothing, so no test can load it. */
async function hasRuntimeCode (file) {
  const { default: ts } = await import('typescript')
  const js = ts.transpileModule(readFileSync(path.join(root, file), 'utf8'), {
    compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022, verbatimModuleSyntax: true, removeComments: true }
  }).outputText
  return js.replace(/^\s*export\s*\{\s*\};?\s*$/gm, '').trim() !== ''
}

const empty = () => Object.fromEntries(METRICS.map((m) => [m, { covered: 0, total: 0 }]))
const pct = ({ covered, total }) => (total === 0 ? 100 : (100 * covered) / total)
const shown = (c) => `${pct(c).toFixed(2).padStart(6)}% ${`${c.covered}/${c.total}`.padEnd(11)}`
const required = Object.entries(MINIMUM).map(([m, p]) => `${p}% of ${m}`).join(' and ')

/** The per-folder table and the gate; returns the exit status. */
async function folders (summary) {
  const files = new Map() // 'lib/fastify/claim.ts' -> { lines, branches, functions }
  for (const [file, counts] of Object.entries(summary)) {
    if (file === 'total') continue
    const rel = path.relative(root, file).split(path.sep).join('/')
    if (FOLDERS.some((f) => rel.startsWith(`${f}/`))) files.set(rel, counts)
  }
  const rows = new Map(ROWS.map((r) => [r, empty()]))
  const all = empty()
  for (const [file, counts] of files) {
    for (const sum of [all, ...ROWS.filter((r) => file.startsWith(r)).map((r) => rows.get(r))]) {
      for (const metric of METRICS) {
        sum[metric].covered += counts[metric].covered
        sum[metric].total += counts[metric].total
      }
    }
  }
  const never = []
  for (const file of FOLDERS.flatMap(sourceFiles)) {
    if (!files.has(file) && await hasRuntimeCode(file)) never.push(file)
  }

  const total = 'lib/ + drivers/ + client/'
  const width = total.length + 2
  const out = ['', `coverage per folder (each of lib/, drivers/, client/ needs ${required})`, `${'folder'.padEnd(width)}${METRICS.map((m) => m.padEnd(20)).join('')}`]
  const failed = []
  for (const [row, sums] of rows) {
    const sub = row.split('/').length > 2 // drivers/postgres/: shown, the gate is on drivers/
    out.push(`${((sub ? '  ' : '') + row).padEnd(width)}${METRICS.map((m) => shown(sums[m])).join(' ')}`)
    if (sub) continue
    if (sums.lines.total === 0) {
      failed.push(`${row} has no coverage recorded`)
      continue
    }
    // Counts that do not map back to the source (a loader whose source maps c8 cannot follow
    // reports a few dozen lines for a whole folder) would pass any threshold: a folder's measured
    // lines must be at least a third of its source lines, comments and blank lines included.
    const sourceLines = sourceFiles(row.slice(0, -1)).reduce((sum, file) => sum + readFileSync(path.join(root, file), 'utf8').split('\n').length, 0)
    if (sums.lines.total < sourceLines / 3) {
      failed.push(`${row} counts ${sums.lines.total} lines of its ${sourceLines}: the coverage data does not map to the source`)
      continue
    }
    for (const [metric, min] of Object.entries(MINIMUM)) {
      if (pct(sums[metric]) < min) failed.push(`${row} ${metric} ${pct(sums[metric]).toFixed(2)}% < ${min}%`)
    }
  }
  out.push(`${total.padEnd(width)}${METRICS.map((m) => shown(all[m])).join(' ')}`)
  if (never.length > 0) {
    out.push('', 'files holding runtime code that no test loaded:', ...never.map((f) => `  ${f}`))
    failed.push(`${never.length} file(s) never loaded`)
  }
  out.push('', failed.length === 0 ? `coverage: ok (${required} in each folder)` : `coverage: below the thresholds: ${failed.join('; ')}`)
  console.log(out.join('\n'))
  return failed.length === 0 ? 0 : 1
}

async function main () {
  const recorded = path.join(root, '.tap', 'coverage')
  if (!existsSync(recorded)) {
    console.error('coverage: no coverage recorded in .tap/coverage: run the whole suite first (npm test)')
    return 1
  }
  const data = mkdtempSync(path.join(os.tmpdir(), 'idem-coverage-'))
  try {
    if (separateBuilds(recorded, data) === 0) {
      console.error('coverage: .tap/coverage holds no coverage data')
      return 1
    }
    // c8 reports paths relative to the working directory, and includes by them
    process.chdir(root)
    return await folders(await c8Report(data))
  } finally {
    rmSync(data, { recursive: true, force: true })
  }
}

process.exitCode = await main().catch((err) => {
  console.error(`coverage: ${err?.stack ?? err}`)
  return 1
})
