import { readdirSync, readFileSync } from 'node:fs'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import t from 'tap'

/**
 * Test files run side by side on one Redis server. A file that empties a database (FLUSHDB) must be
 * the only one using it, or a key another file just wrote vanishes under it; and nothing empties the
 * whole server (FLUSHALL) outside the chaos harness, which runs servers of its own. Read from the
 * sources: every `db: N` a client is opened with, every flushdb() and flushall() call.
 */

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')

function sources (dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const file = path.join(dir, entry.name)
    if (entry.isDirectory()) return entry.name === 'chaos' ? [] : sources(file)
    return entry.name.endsWith('.ts') ? [file] : []
  })
}

t.test('a database a test file flushes is used by no other file, and no file flushes the server', async (t) => {
  const users = new Map<number, Set<string>>()
  const flushers: string[] = []
  for (const file of sources(ROOT)) {
    const text = readFileSync(file, 'utf8')
    const name = path.relative(ROOT, file)
    for (const match of text.matchAll(/\bdb:\s*(\d+)/g)) {
      const db = Number(match[1])
      users.set(db, (users.get(db) ?? new Set()).add(name))
    }
    if (/\.flushdb\(/.test(text)) flushers.push(name)
    t.notOk(/\.flushall\(/.test(text), `${name} does not empty the whole server`)
  }
  t.ok(flushers.length > 0, `the files that flush a database: ${flushers.join(', ')}`)
  for (const flusher of flushers) {
    const dbs = [...users].filter(([, files]) => files.has(flusher)).map(([db]) => db)
    t.ok(dbs.length > 0, `${flusher} opens its clients on a database of its own (db: N)`)
    for (const db of dbs) t.same([...users.get(db) ?? []], [flusher], `database ${db} is ${flusher}'s alone`)
  }
})
