import { spawn } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { existsSync, readFileSync } from 'node:fs'
import path from 'node:path'
import Fastify from 'fastify'
import postgres from 'postgres'
import t, { type Test } from 'tap'
import idempotency from '../../lib/index.js'
import { tsc, tsconfig } from '../helpers/consumer.js'
import { anchors, codeBlocks, links, markdownPages, REPOSITORY, ROOT, type CodeBlock } from '../helpers/markdown.js'
import { documentedPackages, installedBy, packedApp } from '../helpers/packed-app.js'

/**
 * The documentation as a reader meets it: every TypeScript example compiles in an app that has the
 * packed package and only the packages the install lines name, the quick start runs as written
 * from its own commands, links resolve in the repository and in the installed package, and the
 * README says true things about the options.
 */

const TS = new Set(['ts', 'typescript'])
const blocks = markdownPages().flatMap(codeBlocks).filter((b) => TS.has(b.lang))
const fileOf = (block: CodeBlock, index: number): string =>
  `${block.page.replace(/\.md$/, '').replace(/\//g, '-')}-${String(index).padStart(2, '0')}.ts`

/** drizzle-orm, which the ORM recipes of docs/drivers.md import: installed there by scripts/test.mjs (it cannot be a root devDependency). */
const ORM_MODULES = path.join(ROOT, 'test', 'orm', 'node_modules')

/**
 * A block that declares `AtomicTransactionTypes` (an app on node-postgres: `request.idempotency.sql`
 * is a PoolClient) changes that type for every file of its program, since a module augmentation is
 * global; so those blocks compile in a program of their own, and the others against the default
 * (postgres.js's TransactionSql), as two separate apps would.
 */
const declaresClient = (block: CodeBlock): boolean => /\binterface AtomicTransactionTypes\b/.test(block.code)

/** The README's quick start: its commands (```sh) and its app (```ts). */
function quickStart (): { commands: string[][], packages: string[], app: CodeBlock | undefined } {
  const section = codeBlocks('README.md').filter((b) => b.section === 'Quick start')
  const lines = (section.find((b) => b.lang === 'sh')?.code ?? '').split('\n').map((line) => line.replace(/#.*$/, '').trim()).filter((line) => line !== '')
  return {
    // What a reader types before installing: `npm init -y`, `npm pkg set type=module`.
    commands: lines.filter((line) => /^npm (init|pkg)\b/.test(line)).map((line) => line.split(/\s+/)),
    packages: installedBy(section),
    app: section.find((b) => TS.has(b.lang))
  }
}

t.test('the install lines name what the examples need', async (t) => {
  const named = documentedPackages()
  for (const name of ['fastify', 'fastify-idempotency', 'tsx', 'typescript', '@types/node', 'postgres', 'pg', '@types/pg', '@fastify/postgres', 'ioredis']) {
    t.ok(named.includes(name), `an install line names ${name}`)
  }
  const start = quickStart()
  t.same(start.commands, [['npm', 'init', '-y'], ['npm', 'pkg', 'set', 'type=module']], 'the quick start makes the package an ES module, for its top-level await')
  for (const name of ['fastify', 'fastify-idempotency', 'tsx']) t.ok(start.packages.includes(name), `the quick start installs ${name}`)
})

t.test('every TypeScript block of README.md and docs/ type-checks in an app with the packed package and the packages the docs install', async (t) => {
  const checked = blocks.filter((b) => !b.fragment)
  t.ok(checked.length >= 15, `${checked.length} blocks are checked`)
  t.ok(blocks.length - checked.length <= 3, `few blocks are marked <!-- fragment --> (${blocks.length - checked.length})`)
  t.ok(existsSync(path.join(ORM_MODULES, 'drizzle-orm')), 'test/orm/node_modules holds drizzle-orm (scripts/test.mjs runs npm ci there)')
  const programs = [checked.filter((b) => !declaresClient(b)), checked.filter(declaresClient)]
  t.ok((programs[1]?.length ?? 0) >= 3, `${programs[1]?.length} blocks are apps on node-postgres (AtomicTransactionTypes declared)`)
  const files: Record<string, string> = {}
  const origin = new Map<string, CodeBlock>()
  programs.forEach((group, program) => {
    for (const block of group) {
      const name = `p${program}/${fileOf(block, checked.indexOf(block))}`
      files[name] = `${block.code}\nexport {}\n` // a module: its declarations are its own, top-level await works
      origin.set(name, block)
    }
    files[`p${program}/tsconfig.json`] = tsconfig({ module: 'nodenext', moduleResolution: 'nodenext' }, ['*.ts'])
  })
  const dir = await packedApp(t, { files, packages: documentedPackages(), commands: quickStart().commands, alsoFrom: [ORM_MODULES] })
  // One compiler run per program, both at once.
  const results = await Promise.all(programs.map(async (_group, program) => await tsc(dir, `p${program}/tsconfig.json`)))
  results.forEach((result, program) => {
    const errors = result.out.split('\n').filter((line) => /error TS\d+/.test(line)).map((line) => {
      const m = /^([^(]+)\((\d+),(\d+)\): (.*)$/.exec(line)
      const block = m === null ? undefined : origin.get(m[1] ?? '')
      return block === undefined || m === null ? line : `${block.page}:${block.line + Number(m[2]) - 1}: ${m[4] ?? ''}`
    })
    t.same(errors, [], `program ${program}: no type errors`)
    t.equal(result.code, 0, result.out.slice(0, 2000))
  })
})

/**
 * Runs a README block as the quick start says: an app made with its commands, the packed package
 * and `packages` installed, `tsx app.ts`. Resolves to the URL it prints.
 */
async function runApp (t: Test, block: CodeBlock, packages: readonly string[], env: NodeJS.ProcessEnv = {}): Promise<string> {
  const dir = await packedApp(t, { files: { 'app.ts': block.code }, packages, commands: quickStart().commands })
  const child = spawn(process.execPath, ['--import', 'tsx', 'app.ts'], { cwd: dir, env: { ...process.env, PORT: '0', ...env }, stdio: ['ignore', 'pipe', 'pipe'] })
  t.teardown(() => { child.kill() })
  let output = ''
  return await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no "listening on" within 30 s: ${output}`)), 30_000)
    const seen = (chunk: Buffer): void => {
      output += chunk.toString()
      const m = /listening on (http:\/\/\S+)/.exec(output)
      if (m !== null) { clearTimeout(timer); resolve(m[1] ?? '') }
    }
    child.stdout.on('data', seen)
    child.stderr.on('data', seen)
    child.on('exit', (code) => { clearTimeout(timer); reject(new Error(`exited (${code}) before listening: ${output}`)) })
  })
}

t.test('the quick start runs as written: authenticated, scoped, replayed', async (t) => {
  const { app: block, packages } = quickStart()
  if (block === undefined) return t.fail('README.md has a ```ts block under ## Quick start')
  const url = await runApp(t, block, packages) // only what the quick start installs
  const pay = (token: string | null, key: string | null): Promise<Response> => fetch(`${url}/payments`, {
    method: 'POST',
    headers: {
      'content-type': 'application/json',
      ...(token === null ? {} : { authorization: `Bearer ${token}` }),
      ...(key === null ? {} : { 'idempotency-key': `"${key}"` })
    },
    body: JSON.stringify({ amount: 1000, currency: 'EUR' })
  })
  const key = '8e03978e-40d5-43e8-bc93-6894a57f9324'
  const first = await pay('token-alice', key)
  const firstBody = await first.text()
  t.equal(first.status, 201)
  t.equal(first.headers.get('idempotent-replayed'), null)
  t.match(JSON.parse(firstBody), { id: 'ch_1', amount: 1000, currency: 'EUR' })
  const again = await pay('token-alice', key)
  t.equal(again.status, 201)
  t.equal(again.headers.get('idempotent-replayed'), 'true', 'the retry is a replay')
  t.equal(await again.text(), firstBody, 'byte for byte')
  t.equal(again.headers.get('location'), '/payments/ch_1')
  const bob = await pay('token-bob', key)
  t.equal(bob.headers.get('idempotent-replayed'), null, 'the same key from another account is its own operation')
  t.match(await bob.json(), { id: 'ch_2' })
  t.equal((await pay('token-alice', null)).status, 400, 'required: true refuses a POST without a key')
  t.equal((await pay(null, key)).status, 401, 'the auth hook answers first')
})

t.test('the @fastify/postgres example runs as written: atomic mode on fastify.pg.pool, one payment per key, a failed insert rolled back', async (t) => {
  const databaseUrl = process.env.DATABASE_URL
  if (databaseUrl === undefined || databaseUrl === '') return t.fail('DATABASE_URL is not set: run it through scripts/test.mjs')
  const block = blocks.find((b) => b.page === 'README.md' && b.section === 'PostgreSQL: postgres.js or node-postgres')
  if (block === undefined) return t.fail('README.md has a ```ts block under ## PostgreSQL: postgres.js or node-postgres')
  // What the quick start installs, and the section's install line for this app (its first: node-postgres).
  const install = codeBlocks('README.md').find((b) => b.section === block.section && b.lang === 'sh')
  const packages = [...quickStart().packages, ...installedBy(install === undefined ? [] : [{ ...install, code: install.code.split('\n')[0] ?? '' }])]
  t.ok(packages.includes('@fastify/postgres') && packages.includes('pg'), `the section installs what the app imports (${packages.join(' ')})`)
  // The block's payments table, in a schema of this test's own (found through search_path); the
  // store's table is the default public.idempotency_records, as the block has it.
  const schema = `idem_readme_${randomBytes(4).toString('hex')}`
  const admin = postgres(databaseUrl, { max: 1, onnotice: () => {} })
  t.teardown(async () => {
    await admin`DROP SCHEMA IF EXISTS ${admin(schema)} CASCADE`
    await admin.end({ timeout: 2 })
  })
  await admin`CREATE SCHEMA ${admin(schema)}`
  await admin`CREATE TABLE ${admin(schema)}.payments (id serial PRIMARY KEY, amount integer NOT NULL)`
  const url = await runApp(t, block, packages, { PGOPTIONS: `-c search_path=${schema}` })

  const pay = (key: string, amount: number | null, account: string | null = 'acct_readme'): Promise<Response> => fetch(`${url}/payments`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...(account === null ? {} : { 'x-account-id': account }), 'idempotency-key': `"${key}"` },
    body: JSON.stringify({ amount })
  })
  const payments = async (): Promise<number[]> => (await admin`SELECT amount FROM ${admin(schema)}.payments ORDER BY id`).map((row) => Number(row.amount))
  const recorded = async (key: string): Promise<string[]> =>
    (await admin`SELECT state FROM public.idempotency_records WHERE scope = 'acct_readme' AND key = ${key}`).map((row) => String(row.state))

  const key = `readme-${randomBytes(6).toString('hex')}`
  const first = await pay(key, 1000)
  const body = await first.text()
  t.equal(first.status, 201, body)
  t.match(JSON.parse(body), { id: 1, amount: 1000 })
  const again = await pay(key, 1000)
  t.equal(again.status, 201)
  t.equal(again.headers.get('idempotent-replayed'), 'true', 'the retry is a replay')
  t.equal(await again.text(), body, 'byte for byte')
  t.same(await payments(), [1000], 'one payment, committed')
  t.same(await recorded(key), ['completed'])

  // amount null violates NOT NULL: the insert fails, the handler throws, the claim rolls back with it.
  const other = `readme-${randomBytes(6).toString('hex')}`
  t.equal((await pay(other, null)).status, 500)
  t.same(await payments(), [1000], 'nothing written')
  t.same(await recorded(other), [], 'no record: the key is free')
  const retry = await pay(other, 5)
  t.equal(retry.status, 201, 'the key runs afresh')
  t.equal(retry.headers.get('idempotent-replayed'), null)
  t.same(await payments(), [1000, 5])

  const anonymous = await pay(`readme-${randomBytes(6).toString('hex')}`, 7, null)
  t.equal(anonymous.status, 401, 'a request without an account is refused, not given a shared scope')
  t.same(await payments(), [1000, 5], 'and runs nothing')
})

t.test('relative links resolve to files, and anchors to headings; absolute links into the repository use its URL', async (t) => {
  const problems: string[] = []
  for (const link of markdownPages().flatMap(links)) {
    const where = `${link.page}:${link.line}: ${link.target}`
    if (/^[a-z]+:/i.test(link.target)) {
      if (link.target.includes('github.com/fastify-idempotency/') && !link.target.startsWith(`${REPOSITORY}/`)) problems.push(`${where} (not ${REPOSITORY})`)
      continue
    }
    const [file = '', anchor] = link.target.split('#')
    const target = file === '' ? link.page : path.posix.normalize(path.posix.join(path.posix.dirname(link.page), file))
    if (target.startsWith('..') || !existsSync(path.join(ROOT, target))) { problems.push(`${where} (no such file)`); continue }
    if (anchor !== undefined && target.endsWith('.md') && !anchors(target).has(anchor)) problems.push(`${where} (no such heading in ${target})`)
  }
  t.same(problems, [])

  // A page named in code text (`real-clients.md`) is a reference a reader follows too.
  const named = markdownPages().flatMap((page) => [...readFileSync(path.join(ROOT, page), 'utf8').matchAll(/`([\w./-]+\.md)`/g)]
    .map((m) => m[1] ?? '').filter((name) => !existsSync(path.join(ROOT, name)) && !existsSync(path.join(ROOT, 'docs', name)))
    .map((name) => `${page}: ${name}`))
  t.same(named, [], 'every page named in code text exists')
})

/** The repository's own folders: in the installed package (which ships docs/, not these) a path into one leads nowhere. */
const REPOSITORY_PATH = /(?<![\w./@-])(?:examples|test|benchmarks|scripts|lib|drivers|client|conformance|\.ci)\/[\w./-]*/g
const IN_REPOSITORY = new RegExp(`^${REPOSITORY.replace(/[.]/g, '\\.')}/(?:blob|tree)/main/(.+)$`)

t.test('no page names a repository file outside an https link to it, and every such link names a file of the checkout', async (t) => {
  const bare: string[] = []
  const broken: string[] = []
  let linked = 0
  for (const page of markdownPages()) {
    const text = readFileSync(path.join(ROOT, page), 'utf8')
    // A fenced block that clones the repository runs in a clone, where its paths exist.
    const outsideClones = text.replace(/^([ \t]*)```[^\n]*\n[\s\S]*?^\1```[ \t]*$/gm, (block) => block.includes(`git clone ${REPOSITORY}`) ? block.replace(/[^\n]/g, '') : block)
    for (const [i, line] of outsideClones.split('\n').entries()) {
      for (const m of line.matchAll(/\[[^\]]*\]\((https:[^)\s]+)\)|<(https:[^>\s]+)>|(https:\/\/[^\s)>\]`]+)/g)) {
        const url = m[1] ?? m[2] ?? m[3] ?? ''
        const file = IN_REPOSITORY.exec(url.split('#')[0] ?? '')?.[1]
        if (file === undefined) continue
        linked++
        if (!existsSync(path.join(ROOT, decodeURIComponent(file)))) broken.push(`${page}: ${url}`)
      }
      // Link text and target included: an https link is how a page names a repository file.
      const prose = line.replace(/\[[^\]]*\]\(https:[^)\s]+\)|<https:[^>\s]+>|https:\/\/[^\s)>\]`]+/g, '')
      for (const m of prose.matchAll(REPOSITORY_PATH)) bare.push(`${page}:${i + 1}: ${m[0]}`)
    }
  }
  t.same(bare, [], `a repository path is an https link to it (${REPOSITORY}/blob/main/<path>), or sits in a block that clones the repository`)
  t.same(broken, [], 'every https link into the repository names a file that exists')
  t.ok(linked >= 10, `${linked} links into the repository are checked`)
})

t.test('the README names every option, and exactly the ones that cannot be set per route', async (t) => {
  const readme = readFileSync(path.join(ROOT, 'README.md'), 'utf8')
  const table = readme.slice(readme.indexOf('## Options'), readme.indexOf('### Per route'))
  const documented = new Set([...table.matchAll(/^\| `(\w+)/gm)].map((m) => m[1] ?? '').filter((n) => n !== 'option'))

  // The plugin's own lists, read from the errors it gives for an unknown option.
  const listIn = (err: unknown): string[] => /one of ([\w, ]+)/.exec(String((err as Error).message))?.[1]?.split(', ').map((s) => s.trim()) ?? []
  const app = Fastify()
  t.teardown(() => app.close())
  const registration = listIn(await app.register(idempotency, { bogus: 1 } as never).then(() => null, (e: unknown) => e))
  const other = Fastify()
  t.teardown(() => other.close())
  await other.register(idempotency, { scope: () => 'x' })
  let perRoute: string[] = []
  try { other.post('/x', { config: { idempotency: { bogus: 1 } as never } }, async () => ({})) } catch (err) { perRoute = listIn(err) }
  t.ok(registration.length > 10 && perRoute.length > 10, 'read the option lists')

  t.same([...documented].sort(), [...registration].sort(), 'the options table lists every option')
  const sentence = /Every option above except ([^.]+?) can be set per route/s.exec(readme)?.[1] ?? ''
  const except = [...sentence.matchAll(/`(\w+)`/g)].map((m) => m[1] ?? '')
  t.same(except.sort(), registration.filter((n) => !perRoute.includes(n)).sort(), 'the registration-only options are named exactly')
})

t.test('the README is a front page: under 40 KB, a table of contents, the install line and the commands for a clone near its top', async (t) => {
  const readme = readFileSync(path.join(ROOT, 'README.md'), 'utf8')
  t.ok(Buffer.byteLength(readme) < 40_000, `${Buffer.byteLength(readme)} bytes (the registry truncates at 64 KiB)`)
  t.match(readme, /^## Contents$/m)
  const top = readme.split('\n').slice(0, 30).join('\n')
  t.match(top, /^npm install fastify-idempotency$/m, 'how a user installs it')
  t.match(top, /clone of this repository[\s\S]*npm install && npm run demo[\s\S]*npm install && npm test/, 'the two commands for a clone, marked as such')
  for (const script of ['demo', 'test']) {
    const pkg = JSON.parse(readFileSync(path.join(ROOT, 'package.json'), 'utf8')) as { scripts: Record<string, string> }
    t.type(pkg.scripts[script], 'string', `npm run ${script} exists`)
  }
})

t.test("the README's security section cites tests that exist: each `file` is a test file and each quoted title is in it", async (t) => {
  const readme = readFileSync(path.join(ROOT, 'README.md'), 'utf8')
  const start = readme.indexOf('\n## Security\n')
  t.ok(start !== -1, 'there is a Security section')
  const section = readme.slice(start + 1, readme.indexOf('\n## ', start + 1))
  let cited = 0
  // A citation is a parenthesis naming test files, each optionally followed by `: "title"` or `: "title", "title"`.
  for (const [, inside] of section.matchAll(/\(([^()]*`[a-z0-9/-]+`[^()]*)\)/g)) {
    for (const part of (inside ?? '').split(';')) {
      const file = /`([a-z0-9-]+(?:\/[a-z0-9-]+)*)`/.exec(part)?.[1]
      if (file === undefined || file.startsWith('@fastify/')) continue
      const source = path.join(ROOT, 'test', `${file}.test.ts`)
      if (!existsSync(source)) {
        t.fail(`test/${file}.test.ts does not exist (cited in: ${part.trim()})`)
        continue
      }
      cited++
      const text = readFileSync(source, 'utf8').replace(/\s+/g, ' ')
      for (const [, title] of part.matchAll(/"([^"]+)"/g)) {
        t.ok(text.includes(title ?? ''), `test/${file}.test.ts has a test titled with "${title}"`)
      }
    }
  }
  t.ok(cited >= 15, `${cited} citations of test files`)
})
