import { existsSync, mkdirSync, mkdtempSync, readFileSync, renameSync, rmSync, symlinkSync, writeFileSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import type { Test } from 'tap'
import { run } from './consumer.js'
import { codeBlocks, markdownPages, ROOT, type CodeBlock } from './markdown.js'

/**
 * An application as a user makes it from the documentation: the package as `npm pack` packs it
 * (not the repository), plus exactly the packages the documentation's install lines name and what
 * npm would install with them (their dependencies, and the peers npm installs by itself). Those
 * are linked from the repository's node_modules (and `alsoFrom`), at the versions the suite tests,
 * so building the app needs neither the network nor a registry, and takes a fraction of a second
 * once the package is packed. Anything else is absent: a block that imports a package no install
 * line names fails to resolve.
 */

interface Manifest {
  readonly name?: string
  readonly dependencies?: Record<string, string>
  readonly optionalDependencies?: Record<string, string>
  readonly peerDependencies?: Record<string, string>
  readonly peerDependenciesMeta?: Record<string, { optional?: boolean }>
}

const readManifest = (dir: string): Manifest => JSON.parse(readFileSync(path.join(dir, 'package.json'), 'utf8')) as Manifest

/**
 * What npm installs along with a package: its dependencies and its non-optional peers, then its
 * optional dependencies (those for other platforms are not installed, so only the ones present).
 */
function requires (manifest: Manifest): Array<{ name: string, optional: boolean }> {
  const peers = Object.keys(manifest.peerDependencies ?? {}).filter((name) => manifest.peerDependenciesMeta?.[name]?.optional !== true)
  return [
    ...[...Object.keys(manifest.dependencies ?? {}), ...peers].map((name) => ({ name, optional: false })),
    ...Object.keys(manifest.optionalDependencies ?? {}).map((name) => ({ name, optional: true }))
  ]
}

/**
 * The package names of every `npm install …` line of these ```sh blocks (flags, versions and
 * comments left out), in order, without duplicates. A line of a clone's commands
 * (`npm install && npm test`) names none.
 */
export function installedBy (blocks: readonly CodeBlock[]): string[] {
  const names = new Set<string>()
  for (const block of blocks.filter((b) => b.lang === 'sh')) {
    for (const line of block.code.split('\n')) {
      const m = /^\s*npm (?:install|i|add)\b([^#&;|]*)/.exec(line)
      for (const token of (m?.[1] ?? '').trim().split(/\s+/)) {
        if (token === '' || token.startsWith('-')) continue
        names.add(token.replace(/(.)@[^/]*$/, '$1'))
      }
    }
  }
  return [...names]
}

/** Every package an install line of README.md or docs/ names. */
export function documentedPackages (): string[] {
  return installedBy(markdownPages().flatMap(codeBlocks))
}

let packed: Promise<string> | null = null

/**
 * The tarball `npm pack` makes of the repository, once per test process. Packed with
 * --ignore-scripts: scripts/test.mjs has just built dist/, and the prepack build would delete it
 * under the test files that read it meanwhile (test/package/package.test.ts checks that prepack builds).
 */
export function tarball (): Promise<string> {
  packed ??= (async () => {
    const out = mkdtempSync(path.join(os.tmpdir(), 'fastify-idempotency-pack-'))
    process.once('exit', () => { rmSync(out, { recursive: true, force: true }) })
    const result = await run('npm', ['pack', '--ignore-scripts', '--json', '--loglevel=error', '--pack-destination', out], ROOT)
    if (result.code !== 0) throw new Error(`npm pack failed: ${result.out}`)
    const [info] = JSON.parse(result.out.slice(result.out.indexOf('['))) as Array<{ filename: string }>
    return path.join(out, info?.filename ?? '')
  })()
  return packed
}

/**
 * A throwaway app (removed at teardown) holding `files`, with the packed package extracted into
 * its node_modules and `packages` linked there with everything npm would install along.
 * `commands` (`npm init -y`, `npm pkg set type=module`) run in it first, as a reader would type them.
 */
export async function packedApp (t: Test, options: {
  readonly files: Record<string, string>
  readonly packages: readonly string[]
  readonly commands?: ReadonlyArray<readonly string[]>
  readonly alsoFrom?: readonly string[]
}): Promise<string> {
  const dir = mkdtempSync(path.join(os.tmpdir(), 'fastify-idempotency-app-'))
  t.teardown(() => { rmSync(dir, { recursive: true, force: true }) })
  for (const command of options.commands ?? []) {
    const [name = '', ...args] = command
    const result = await run(name, args, dir)
    if (result.code !== 0) throw new Error(`${command.join(' ')} failed in the app: ${result.out}`)
  }
  const modules = path.join(dir, 'node_modules')
  mkdirSync(modules, { recursive: true })

  const extracted = await run('tar', ['-xzf', await tarball(), '-C', dir], dir)
    .catch((err: unknown) => ({ code: 1, out: String(err) }))
  if (extracted.code !== 0) throw new Error(`tar failed: ${extracted.out}`)
  const own = path.join(modules, 'fastify-idempotency')
  renameSync(path.join(dir, 'package'), own)

  const roots = [path.join(ROOT, 'node_modules'), ...(options.alsoFrom ?? [])]
  const linked = new Set<string>(['fastify-idempotency'])
  /** Links `name` at the top of the app's node_modules (npm hoists what it can), then what it requires. */
  const install = (name: string, optional = false): void => {
    if (linked.has(name)) return
    const source = roots.map((root) => path.join(root, name)).find((candidate) => existsSync(path.join(candidate, 'package.json')))
    if (source === undefined && optional) return
    if (source === undefined) throw new Error(`${name} is not installed in the repository (npm ci), so the app cannot have it`)
    linked.add(name)
    mkdirSync(path.dirname(path.join(modules, name)), { recursive: true })
    symlinkSync(source, path.join(modules, name), 'dir')
    requiredBy(source)
  }
  /** What a package requires: from its own nested node_modules when it has a copy there, else hoisted. */
  const requiredBy = (from: string, seen = new Set<string>()): void => {
    for (const { name, optional } of requires(readManifest(from))) {
      const nested = path.join(from, 'node_modules', name)
      if (!existsSync(nested)) { install(name, optional); continue }
      if (!seen.has(nested)) { seen.add(nested); requiredBy(nested, seen) }
    }
  }
  requiredBy(own)
  for (const name of options.packages) install(name)

  for (const [name, text] of Object.entries(options.files)) {
    mkdirSync(path.dirname(path.join(dir, name)), { recursive: true })
    writeFileSync(path.join(dir, name), text)
  }
  return dir
}
