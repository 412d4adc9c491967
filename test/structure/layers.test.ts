import { readdirSync, readFileSync } from 'node:fs'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import t from 'tap'
import ts from 'typescript'

/*
 * The package's layers, as its folders show them: lib/core/ is the protocol and knows no framework;
 * lib/http/ is the HTTP surface (key parsing, problems, profiles, options, status route, OpenAPI);
 * lib/fastify/ hooks the core into Fastify; lib/jobs/ runs it for background jobs; drivers/ are
 * stores. Each layer imports only those below it, and no module imports itself back through others.
 */

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..')
const SOURCES = ['lib', 'drivers', 'client', 'conformance']

function sourceFiles (dir: string): string[] {
  return readdirSync(path.join(ROOT, dir), { withFileTypes: true }).flatMap((entry) => {
    const at = path.posix.join(dir, entry.name)
    if (entry.isDirectory()) return sourceFiles(at)
    return entry.name.endsWith('.ts') ? [at] : []
  })
}

/** Every module a file imports, type-only imports included (`import type` ties modules together too), as a repository path or a package name. */
function importsOf (file: string): string[] {
  const { importedFiles } = ts.preProcessFile(readFileSync(path.join(ROOT, file), 'utf8'), true, true)
  return importedFiles.map(({ fileName }) => fileName.startsWith('.')
    ? path.posix.normalize(path.posix.join(path.posix.dirname(file), fileName)).replace(/\.js$/, '.ts')
    : fileName)
}

const graph = new Map(SOURCES.flatMap(sourceFiles).map((file) => [file, importsOf(file)]))

const FRAMEWORK = /^(fastify|fastify-plugin)$/

/** Which imports each layer may not make: the layers above it, and for the core, any framework. */
const FORBIDDEN: ReadonlyArray<{ readonly layer: string, readonly refuses: (target: string) => boolean, readonly why: string }> = [
  { layer: 'lib/core/', refuses: (to) => FRAMEWORK.test(to) || (/^(lib|drivers|client)\//.test(to) && !to.startsWith('lib/core/') && !to.startsWith('client/describe-value')), why: 'the core knows no framework, no HTTP and no driver' },
  { layer: 'lib/http/', refuses: (to) => /^lib\/(fastify|jobs)\//.test(to) || to.startsWith('drivers/'), why: 'the HTTP surface sits below the adapters' },
  { layer: 'lib/jobs/', refuses: (to) => FRAMEWORK.test(to) || /^lib\/(fastify|http)\//.test(to) || to.startsWith('drivers/'), why: 'the job runner needs only the core' },
  // An entry point (index.ts) may load the Fastify augmentation so its users get the request's types.
  { layer: 'drivers/', refuses: (to) => /^lib\/(http|jobs)\//.test(to) || (to.startsWith('lib/fastify/') && to !== 'lib/fastify/types.ts'), why: 'a store depends on the core\'s contracts only' }
]

t.test('each layer imports only the layers below it', async (t) => {
  t.ok(graph.size > 60, `the sources were found (${graph.size} files)`)
  for (const { layer, refuses, why } of FORBIDDEN) {
    const files = [...graph.keys()].filter((file) => file.startsWith(layer))
    t.ok(files.length > 0, `${layer} has files`)
    const crossings = files.flatMap((file) => (graph.get(file) ?? []).filter(refuses).map((to) => `${file} -> ${to}`))
    t.same(crossings, [], `${layer}: ${why}`)
  }
})

t.test('the core does not know Fastify even by name in its types', async (t) => {
  const named = [...graph.keys()].filter((file) => file.startsWith('lib/core/'))
    .filter((file) => /\bFastify(Request|Reply|Instance)\b/.test(readFileSync(path.join(ROOT, file), 'utf8').replace(/\/\*[\s\S]*?\*\/|\/\/.*$/gm, '')))
  t.same(named, [], 'no FastifyRequest, FastifyReply or FastifyInstance below the adapter')
})

/** Tarjan's strongly connected components of `modules`: each with more than one module is a cycle. */
function cyclesOf (modules: ReadonlyMap<string, readonly string[]>): string[][] {
  let next = 0
  const index = new Map<string, number>()
  const low = new Map<string, number>()
  const stack: string[] = []
  const onStack = new Set<string>()
  const cycles: string[][] = []
  const visit = (file: string): void => {
    index.set(file, next)
    low.set(file, next++)
    stack.push(file)
    onStack.add(file)
    for (const to of modules.get(file) ?? []) {
      if (!modules.has(to)) continue
      if (!index.has(to)) {
        visit(to)
        low.set(file, Math.min(low.get(file) as number, low.get(to) as number))
      } else if (onStack.has(to)) {
        low.set(file, Math.min(low.get(file) as number, index.get(to) as number))
      }
    }
    if (low.get(file) !== index.get(file)) return
    const component: string[] = []
    let member: string
    do {
      member = stack.pop() as string
      onStack.delete(member)
      component.push(member)
    } while (member !== file)
    if (component.length > 1) cycles.push(component.sort())
  }
  for (const file of modules.keys()) if (!index.has(file)) visit(file)
  return cycles
}

t.test('no module imports itself back through others (no import cycles)', async (t) => {
  t.same(cyclesOf(graph), [], 'every import cycle, by its modules')
})

t.test('the checks see a cycle and a crossing when there is one', async (t) => {
  // The graph's own shape: an import the rules forbid is visible to them.
  t.ok(importsOf('lib/fastify/claim.ts').includes('lib/core/claim.ts'), 'a relative import resolves to its repository path')
  t.ok(importsOf('lib/http/options.ts').some((to) => FRAMEWORK.test(to)), 'a type-only package import is seen')
  t.ok(FORBIDDEN[0]?.refuses('fastify'), 'the core refuses fastify')
  t.ok(FORBIDDEN[0]?.refuses('lib/http/problems.ts'), 'the core refuses the HTTP surface')
  t.notOk(FORBIDDEN[0]?.refuses('lib/core/store.ts'), 'the core may import itself')
  t.same(cyclesOf(new Map([['a', ['b']], ['b', ['c']], ['c', ['a']], ['d', ['a']]])), [['a', 'b', 'c']], 'a cycle of three is found, and only it')
  t.same(cyclesOf(new Map([['a', ['b']], ['b', []]])), [], 'a chain is no cycle')
})
