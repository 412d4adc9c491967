import { spawn } from 'node:child_process'
import { existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, symlinkSync, writeFileSync } from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import type { Test } from 'tap'
import { ROOT } from './markdown.js'

/**
 * A throwaway project outside the repository that has the package installed as a user has it: its
 * node_modules links every dependency of the repository, and `fastify-idempotency` links the
 * repository itself, so imports go through package.json's `exports` to the built dist/. Packages
 * named in `without` are left out (to show the package runs without them); a scoped name
 * (`@types/pg`) leaves out that one package of its scope. The packages of each node_modules folder
 * in `alsoFrom` are linked too (test/orm/node_modules: drizzle-orm, which cannot be a root
 * devDependency).
 */
export function consumerProject (t: Test, files: Record<string, string>, without: readonly string[] = [], alsoFrom: readonly string[] = []): string {
  const dir = mkdtempSync(path.join(os.tmpdir(), 'fastify-idempotency-consumer-'))
  t.teardown(() => { rmSync(dir, { recursive: true, force: true }) })
  const modules = path.join(dir, 'node_modules')
  mkdirSync(modules)
  for (const from of [path.join(ROOT, 'node_modules'), ...alsoFrom]) {
    for (const name of readdirSync(from)) {
      if (name.startsWith('.') || without.includes(name) || existsSync(path.join(modules, name))) continue
      if (name.startsWith('@') && without.some((left) => left.startsWith(`${name}/`))) {
        // A scope with some of its packages left out (e.g. @types/pg): link the others one by one.
        mkdirSync(path.join(modules, name))
        for (const member of readdirSync(path.join(from, name))) {
          if (without.includes(`${name}/${member}`)) continue
          symlinkSync(path.join(from, name, member), path.join(modules, name, member), 'dir')
        }
        continue
      }
      symlinkSync(path.join(from, name), path.join(modules, name), 'dir')
    }
  }
  symlinkSync(ROOT, path.join(modules, 'fastify-idempotency'), 'dir')
  for (const [name, text] of Object.entries(files)) {
    mkdirSync(path.dirname(path.join(dir, name)), { recursive: true })
    writeFileSync(path.join(dir, name), text)
  }
  return dir
}

export interface Run { readonly code: number | null, readonly out: string }

/** Runs a command to its end, output collected (stdout and stderr together). */
export function run (command: string, args: readonly string[], cwd: string, env: NodeJS.ProcessEnv = {}): Promise<Run> {
  return new Promise((resolve, reject) => {
    const child = spawn(command, args, { cwd, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] })
    let out = ''
    child.stdout.on('data', (d: Buffer) => { out += d.toString() })
    child.stderr.on('data', (d: Buffer) => { out += d.toString() })
    child.on('error', reject)
    child.on('close', (code) => resolve({ code, out }))
  })
}

/** The repository's TypeScript compiler, run with the Node running the tests. */
export function tsc (cwd: string, project = 'tsconfig.json'): Promise<Run> {
  return run(process.execPath, [path.join(ROOT, 'node_modules', 'typescript', 'bin', 'tsc'), '-p', project], cwd)
}

/** What a Node app's tsconfig holds, type-checking only. */
export function tsconfig (compilerOptions: Record<string, unknown>, include: readonly string[]): string {
  return JSON.stringify({
    compilerOptions: { target: 'ES2022', lib: ['ES2023'], types: ['node'], strict: true, noEmit: true, skipLibCheck: true, ...compilerOptions },
    include
  }, null, 2)
}
