import { cpSync, mkdtempSync, readFileSync, rmSync, symlinkSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import t from 'tap'
import { run, tsc, tsconfig } from '../helpers/consumer.js'
import { links, markdownPages, ROOT } from '../helpers/markdown.js'
import { packedApp } from '../helpers/packed-app.js'

/**
 * What `npm pack` puts in the tarball is complete (license, readme, docs, types, every export, the
 * schema, the conformance suite), is built by the pack itself from a checkout without dist/, and
 * holds nothing of the repository's own (tests, benchmark results, source maps without their
 * sources); no page links outside it; and every entry point's types stand on their own.
 */

interface Packed { files: Array<{ path: string }> }

t.test('npm pack: complete, nothing of the repository\'s own, no dead links', async (t) => {
  const result = await run('npm', ['pack', '--dry-run', '--json', '--ignore-scripts', '--loglevel=error'], ROOT)
  t.equal(result.code, 0, result.out)
  const json = result.out.slice(result.out.indexOf('['))
  const files = new Set(((JSON.parse(json) as Packed[])[0]?.files ?? []).map((f) => f.path))
  t.ok(files.size > 20, `${files.size} files`)

  for (const file of ['LICENSE', 'README.md', 'package.json', 'drivers/postgres/schema.sql', 'dist/conformance/index.js', 'dist/conformance/index.d.ts']) {
    t.ok(files.has(file), `${file} is in the tarball`)
  }
  t.match(readFileSync(path.join(ROOT, 'LICENSE'), 'utf8'), /^MIT License\n\nCopyright \(c\) 2026 The fastify-idempotency authors\n/, 'the MIT text and its copyright line')

  const pkg = JSON.parse(readFileSync(path.join(ROOT, 'package.json'), 'utf8')) as { exports: Record<string, string | Record<string, string>> }
  t.ok('./conformance' in pkg.exports && './postgres/schema.sql' in pkg.exports, 'the conformance suite and the schema are exports')
  for (const [entry, target] of Object.entries(pkg.exports)) {
    for (const file of typeof target === 'string' ? [target] : Object.values(target)) {
      t.ok(files.has(file.replace(/^\.\//, '')), `export ${entry}: ${file} is in the tarball`)
    }
  }

  const foreign = [...files].filter((f) => /^(test|benchmarks|examples|scripts|\.ci)\//.test(f) || f.includes('/test/'))
  t.same(foreign, [], 'nothing from test/, benchmarks/ (results included), examples/, scripts/')
  const maps = [...files].filter((f) => f.endsWith('.map') && !files.has(f.replace(/\.js\.map$|\.d\.ts\.map$/, '.ts').replace(/^dist\//, '')))
  t.same(maps, [], 'no source map without its source')
  t.same([...files].filter((f) => f.endsWith('.ts') && !f.endsWith('.d.ts')), [], 'no TypeScript sources')

  for (const page of markdownPages()) t.ok(files.has(page), `${page} is in the tarball`)
  const dead = markdownPages().flatMap(links)
    .filter((l) => !/^[a-z]+:/i.test(l.target) && !l.target.startsWith('#'))
    .map((l) => ({ ...l, file: path.posix.normalize(path.posix.join(path.posix.dirname(l.page), l.target.split('#')[0] ?? '')) }))
    .filter((l) => !files.has(l.file))
    .map((l) => `${l.page}:${l.line}: ${l.target}`)
  t.same(dead, [], 'every relative link of README.md and docs/ points into the tarball')
})

t.test('package.json names the repository, the author and where bugs go', async (t) => {
  const pkg = JSON.parse(readFileSync(path.join(ROOT, 'package.json'), 'utf8')) as Record<string, unknown>
  const repo = 'https://github.com/fastify-idempotency/fastify-idempotency'
  t.same(pkg.repository, { type: 'git', url: `git+${repo}.git` })
  t.equal(pkg.homepage, `${repo}#readme`)
  t.same(pkg.bugs, { url: `${repo}/issues` })
  t.equal(pkg.author, 'The fastify-idempotency authors')
  t.equal(pkg.license, 'MIT')
})

t.test('npm pack builds the package itself: a checkout without dist/ packs dist/ (prepack)', async (t) => {
  // The files a fresh clone has, without dist/; node_modules linked, for the compiler.
  const tree = mkdtempSync(path.join(os.tmpdir(), 'fastify-idempotency-clone-'))
  t.teardown(() => { rmSync(tree, { recursive: true, force: true }) })
  for (const entry of ['package.json', 'tsconfig.json', 'tsconfig.build.json', 'LICENSE', 'README.md', 'docs', 'lib', 'drivers', 'client', 'conformance']) {
    cpSync(path.join(ROOT, entry), path.join(tree, entry), { recursive: true })
  }
  symlinkSync(path.join(ROOT, 'node_modules'), path.join(tree, 'node_modules'), 'dir')
  const result = await run('npm', ['pack', '--dry-run', '--json', '--loglevel=error'], tree)
  t.equal(result.code, 0, result.out.slice(-2000))
  const json = result.out.slice(result.out.indexOf('[\n'))
  const files = new Set(((JSON.parse(json) as Packed[])[0]?.files ?? []).map((f) => f.path))
  for (const file of ['dist/lib/index.js', 'dist/lib/index.d.ts', 'dist/drivers/postgres/index.js', 'dist/client/index.js', 'dist/conformance/index.js']) {
    t.ok(files.has(file), `${file} is in the tarball`)
  }
})

t.test('each server-side entry point alone brings the plugin\'s types for Fastify (request.idempotency, config.idempotency)', async (t) => {
  const route = `const app = Fastify()
app.post('/payments', { config: { idempotency: { wait: 100 } } }, async (request) => ({ key: request.idempotency?.key ?? null }))
`
  const dir = await packedApp(t, {
    packages: ['fastify', '@types/node', 'postgres', 'ioredis'],
    files: {
      'package.json': '{ "type": "module" }',
      'postgres/app.ts': `import Fastify from 'fastify'
import postgres from 'postgres'
import { postgresStore } from 'fastify-idempotency/postgres'

export const store = postgresStore({ sql: postgres('postgres://localhost/app') })
${route}`,
      'postgres/tsconfig.json': tsconfig({ module: 'nodenext', moduleResolution: 'nodenext' }, ['app.ts']),
      'redis/app.ts': `import Fastify from 'fastify'
import { Redis } from 'ioredis'
import { redisPrefilter } from 'fastify-idempotency/redis'

export const prefilter = redisPrefilter({ client: new Redis({ lazyConnect: true }) })
${route}`,
      'redis/tsconfig.json': tsconfig({ module: 'nodenext', moduleResolution: 'nodenext' }, ['app.ts'])
    }
  })
  const [postgresOnly, redisOnly] = await Promise.all([tsc(dir, 'postgres/tsconfig.json'), tsc(dir, 'redis/tsconfig.json')])
  t.equal(postgresOnly?.code, 0, `fastify-idempotency/postgres alone: ${postgresOnly?.out ?? ''}`)
  t.equal(redisOnly?.code, 0, `fastify-idempotency/redis alone: ${redisOnly?.out ?? ''}`)
})
