/**
 * The recipes of docs/jobs.md as modules: a ```ts block under a heading, transpiled (types erased, as
 * tsx or tsc would) and written where its imports resolve, so that the tests run the page's own code
 * and cannot drift from it (test/docs/docs.test.ts type-checks the same blocks against the packed
 * package). The blocks import the package by its name; here those imports lead to the sources, the
 * same modules the tests import, so an error class the recipe checks with `instanceof` is the one
 * the runner throws.
 */
import { randomBytes } from 'node:crypto'
import { mkdirSync, rmSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { pathToFileURL } from 'node:url'
import type { Test } from 'tap'
import ts from 'typescript'
import { codeBlocks, ROOT } from '../helpers/markdown.js'

const PAGE = 'docs/jobs.md'

/** Where each import of the package by name leads in the repository. */
const SOURCES: Record<string, string> = {
  'fastify-idempotency': path.join(ROOT, 'lib', 'index.ts'),
  'fastify-idempotency/postgres': path.join(ROOT, 'drivers', 'postgres', 'index.ts')
}

/** The ```ts block under `heading` (a heading of any level) of docs/jobs.md. */
export function recipeSource (heading: string): string {
  const block = codeBlocks(PAGE).find((b) => b.lang === 'ts' && b.heading === heading)
  if (block === undefined) throw new Error(`${PAGE} has no \`\`\`ts block under "${heading}"`)
  return block.code
}

/**
 * Writes the block under `heading` as an ES module under test/jobs/ (so that `bullmq`, `pg-boss` and
 * `postgres` resolve from the repository's node_modules), removed when `t` ends; resolves its path.
 * A child process imports it by that path.
 */
export function writeRecipe (t: Test, heading: string): string {
  const js = ts.transpileModule(recipeSource(heading), {
    compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022 }
  }).outputText
  const rewritten = js.replace(/(from\s+)(['"])(fastify-idempotency(?:\/postgres)?)\2/g, (whole, from: string, _quote: string, name: string) => {
    const source = SOURCES[name]
    return source === undefined ? whole : `${from}${JSON.stringify(pathToFileURL(source).href)}`
  })
  if (/from\s+['"]fastify-idempotency/.test(rewritten)) throw new Error(`${heading}: an import of the package was not rewritten`)
  const dir = path.join(ROOT, 'test', 'jobs', `.recipes-${randomBytes(4).toString('hex')}`)
  mkdirSync(dir, { recursive: true })
  t.teardown(() => { rmSync(dir, { recursive: true, force: true }) })
  const file = path.join(dir, `${heading.replace(/\W+/g, '-').replace(/^-|-$/g, '').toLowerCase()}.mjs`)
  writeFileSync(file, rewritten)
  return file
}

/** {@link writeRecipe}, imported into this process. */
export async function loadRecipe<T> (t: Test, heading: string): Promise<T> {
  return await import(pathToFileURL(writeRecipe(t, heading)).href) as T
}
