import { existsSync, readdirSync, readFileSync } from 'node:fs'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

/** The repository's root, where README.md and docs/ live. */
export const ROOT = fileURLToPath(new URL('../..', import.meta.url))

/** The repository URL package.json names; absolute links into the repository start with it. */
export const REPOSITORY = 'https://github.com/fastify-idempotency/fastify-idempotency'

/** README.md and every docs/*.md, as paths relative to ROOT. */
export function markdownPages (): string[] {
  const docs = path.join(ROOT, 'docs')
  return ['README.md', ...(existsSync(docs) ? readdirSync(docs) : []).filter((f) => f.endsWith('.md')).sort().map((f) => `docs/${f}`)]
}

export interface CodeBlock {
  readonly page: string
  /** 1-based line of the block's first code line in its page. */
  readonly line: number
  readonly lang: string
  readonly code: string
  /** The line right above the fence is `<!-- fragment -->`. */
  readonly fragment: boolean
  /** The `##` heading the block is under. */
  readonly section: string
  /** The nearest heading above the block, of any level. */
  readonly heading: string
}

/** Fenced code blocks, indented ones (inside list items) included, with their indentation removed. */
export function codeBlocks (page: string): CodeBlock[] {
  const lines = readFileSync(path.join(ROOT, page), 'utf8').split('\n')
  const blocks: CodeBlock[] = []
  let section = ''
  let heading = ''
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i] ?? ''
    if (/^#{1,2} /.test(line)) section = line.replace(/^#+ /, '')
    if (/^#{1,6} /.test(line)) heading = line.replace(/^#+ /, '')
    const open = /^(\s*)```(\S*)\s*$/.exec(line)
    if (open === null) continue
    const indent = open[1] ?? ''
    let end = i + 1
    while (end < lines.length && !/^\s*```\s*$/.test(lines[end] ?? '')) end++
    const code = lines.slice(i + 1, end).map((l) => l.startsWith(indent) ? l.slice(indent.length) : l).join('\n')
    blocks.push({ page, line: i + 2, lang: open[2] ?? '', code, fragment: (lines[i - 1] ?? '').trim() === '<!-- fragment -->', section, heading })
    i = end
  }
  return blocks
}

export interface Link {
  readonly page: string
  readonly line: number
  readonly target: string
}

/** Markdown links and images outside code (fences and inline code spans). */
export function links (page: string): Link[] {
  const lines = readFileSync(path.join(ROOT, page), 'utf8').split('\n')
  const found: Link[] = []
  let fenced = false
  for (const [i, raw] of lines.entries()) {
    if (/^\s*```/.test(raw)) { fenced = !fenced; continue }
    if (fenced) continue
    const line = raw.replace(/`[^`]*`/g, '') // a code span is text, even when it looks like a link
    for (const m of line.matchAll(/\]\(([^)\s]+)\)/g)) found.push({ page, line: i + 1, target: m[1] ?? '' })
  }
  return found
}

/** GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens. */
export function slug (heading: string): string {
  return heading.trim().toLowerCase().replace(/[^\p{L}\p{N}\s_-]/gu, '').replace(/\s/g, '-')
}

/** The anchors of a page's headings. */
export function anchors (page: string): Set<string> {
  const text = readFileSync(path.join(ROOT, page), 'utf8').replace(/^\s*```[\s\S]*?^\s*```/gm, '')
  return new Set([...text.matchAll(/^#{1,6} (.+)$/gm)].map((m) => slug(m[1] ?? '')))
}
