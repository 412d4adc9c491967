/**
 * The statement forms Citus (13.2, tables distributed by `scope`) refuses or plans differently,
 * as a check over statement texts: `citusViolations(text)` lists each rule a statement breaks.
 * It is a check over the driver's own fixed texts, not a SQL parser: it knows the few shapes those
 * texts take (one statement, or a WITH whose parts write), and names functions, not types. What it
 * looks for, in a part of a statement that writes (INSERT, UPDATE, DELETE, alone or in a WITH):
 *
 * - a function that is not IMMUTABLE (now(), statement_timestamp(), random(), ...) inside CASE or
 *   COALESCE, or anywhere in RETURNING: Citus refuses the statement (SQLSTATE 0A000);
 * - `ON CONFLICT … DO UPDATE` whose SET or WHERE holds such a function or interval arithmetic
 *   (timestamptz + interval is STABLE): only IMMUTABLE expressions are accepted there;
 * - a VOLATILE function (clock_timestamp(), gen_random_uuid(), random(), ...) in an UPDATE or DELETE;
 * - an UPDATE or DELETE that names no `scope = $n` and is not the bounded batch Citus distributes,
 *   `(scope, …) IN (SELECT scope, … LIMIT $n)`.
 *
 * And in any statement: `ctid`, `SKIP LOCKED`, a row lock (FOR UPDATE, FOR SHARE, ...) without
 * `scope = $n`, `set_config(…)` of a setting (Citus forwards SET LOCAL to the workers, never a
 * function call; the one exception is the driver's own transaction mark, which only the
 * coordinator's session reads: drivers/postgres/client.ts, MARK_SETTING),
 * a primary key or unique index that leaves out `scope`, and DDL sent in a text of several commands
 * (a worker refuses it).
 */

import { MARK_SETTING } from '../../drivers/postgres/client.js'

/** Not IMMUTABLE: the clock, randomness, sequences. */
const NOT_IMMUTABLE = /\b(?:now|statement_timestamp|transaction_timestamp|clock_timestamp|timeofday|random|setseed|gen_random_uuid|uuid_generate_v\w+|nextval|currval|lastval|setval|age|txid_current|pg_current_xact_id)\s*\(|\b(?:current_timestamp|current_date|current_time|localtimestamp|localtime)\b/
/** VOLATILE: a new value at every call. */
const VOLATILE = /\b(?:clock_timestamp|timeofday|random|setseed|gen_random_uuid|uuid_generate_v\w+|nextval|setval)\s*\(/
const SCOPE_BOUND = /\bscope\s*=\s*\$\d+/
const BOUNDED_BATCH = /\(\s*scope\s*,[^()]*\)\s+in\s+\(\s*select\s+scope\s*,[^()]*\bfrom\b[\s\S]*\blimit\s+\$\d+/

/**
 * Lower case, comments removed, whitespace collapsed, string literals emptied ('…' becomes '') and
 * quoted identifiers reduced to "x", so that nothing inside them is taken for SQL.
 */
export function normalize (text: string): string {
  let out = ''
  for (let i = 0; i < text.length;) {
    const c = text.charAt(i)
    if (c === '-' && text[i + 1] === '-') {
      const end = text.indexOf('\n', i)
      i = end === -1 ? text.length : end
    } else if (c === '/' && text[i + 1] === '*') {
      const end = text.indexOf('*/', i + 2)
      i = end === -1 ? text.length : end + 2
      out += ' '
    } else if (c === "'") {
      let j = i + 1
      while (j < text.length && !(text[j] === "'" && text[j + 1] !== "'")) j += text[j] === "'" ? 2 : 1
      out += "''"
      i = j + 1
    } else if (c === '"') {
      let j = i + 1
      while (j < text.length && !(text[j] === '"' && text[j + 1] !== '"')) j += text[j] === '"' ? 2 : 1
      out += '"x"'
      i = j + 1
    } else {
      out += c.toLowerCase()
      i++
    }
  }
  return out.replace(/\s+/g, ' ').trim()
}

/** Index of the parenthesis closing the one at `open`. */
function closing (text: string, open: number): number {
  let depth = 0
  for (let i = open; i < text.length; i++) {
    if (text[i] === '(') depth++
    else if (text[i] === ')' && --depth === 0) return i
  }
  return text.length
}

/** The text with every parenthesised group blanked out: what is left is the statement's top level. */
function topLevel (text: string): string {
  let out = ''
  let depth = 0
  for (const c of text) {
    if (c === '(') depth++
    out += depth === 0 ? c : ' '
    if (c === ')') depth--
  }
  return out
}

/** A statement's parts: each CTE body of a WITH, then its main statement. */
function parts (text: string): string[] {
  const found: string[] = []
  let rest = text
  const head = /^with\s+(?:recursive\s+)?/.exec(rest)
  if (head !== null) {
    rest = rest.slice(head[0].length)
    for (;;) {
      const cte = /^[\w"]+\s*(?:\([^()]*\)\s*)?as\s+(?:not\s+)?(?:materialized\s+)?\(/.exec(rest)
      if (cte === null) break
      const open = cte[0].length - 1
      const close = closing(rest, open)
      found.push(...parts(rest.slice(open + 1, close).trim()))
      rest = rest.slice(close + 1).replace(/^\s*,\s*/, '')
    }
  }
  found.push(rest.trim())
  return found
}

/** The spans of every CASE … END and COALESCE( … ) in a part. */
function conditionalSpans (part: string): string[] {
  const spans: string[] = []
  for (const match of part.matchAll(/\bcoalesce\s*\(/g)) {
    const open = match.index + match[0].length - 1
    spans.push(part.slice(open, closing(part, open) + 1))
  }
  for (const match of part.matchAll(/\bcase\b/g)) {
    let depth = 0
    const words = /\b(case|end)\b/g
    words.lastIndex = match.index
    for (let word = words.exec(part); word !== null; word = words.exec(part)) {
      depth += word[1] === 'case' ? 1 : -1
      if (depth === 0) {
        spans.push(part.slice(match.index, word.index + 3))
        break
      }
    }
  }
  return spans
}

function writingPartViolations (part: string): string[] {
  const violations: string[] = []
  const kind = /^(insert|update|delete)\b/.exec(part)?.[1]
  if (kind === undefined) return violations
  for (const span of conditionalSpans(part)) {
    if (NOT_IMMUTABLE.test(span)) violations.push(`a function that is not IMMUTABLE inside CASE or COALESCE of ${kind.toUpperCase()}: ${span}`)
  }
  const top = topLevel(part)
  const returning = top.search(/\breturning\b/)
  if (returning !== -1 && NOT_IMMUTABLE.test(part.slice(returning))) {
    violations.push(`a function that is not IMMUTABLE in RETURNING: ${part.slice(returning)}`)
  }
  const doUpdate = top.search(/\bdo update\b/)
  if (doUpdate !== -1) {
    const clause = part.slice(doUpdate, returning === -1 ? undefined : returning)
    if (NOT_IMMUTABLE.test(clause) || /\binterval\b/.test(clause)) {
      violations.push(`ON CONFLICT DO UPDATE with an expression that is not IMMUTABLE: ${clause}`)
    }
  }
  if (kind === 'update' || kind === 'delete') {
    const volatile = VOLATILE.exec(part)
    if (volatile !== null) violations.push(`a VOLATILE function in ${kind.toUpperCase()}: ${volatile[0]}`)
    if (!SCOPE_BOUND.test(part) && !BOUNDED_BATCH.test(part)) {
      violations.push(`${kind.toUpperCase()} neither names scope = $n nor is a (scope, …) IN (SELECT … LIMIT $n) batch`)
    }
  }
  return violations
}

function ddlViolations (command: string): string[] {
  const violations: string[] = []
  for (const match of command.matchAll(/\bprimary key\s*\(/g)) {
    const open = match.index + match[0].length - 1
    const columns = command.slice(open + 1, closing(command, open))
    if (!/\bscope\b/.test(columns)) violations.push(`a primary key without scope: (${columns})`)
  }
  for (const match of command.matchAll(/\bunique\s*\(/g)) {
    const open = match.index + match[0].length - 1
    const columns = command.slice(open + 1, closing(command, open))
    if (!/\bscope\b/.test(columns)) violations.push(`a unique constraint without scope: (${columns})`)
  }
  const uniqueIndex = /^create unique index\b[^(]*\(/.exec(command)
  if (uniqueIndex !== null) {
    const open = uniqueIndex[0].length - 1
    const columns = command.slice(open + 1, closing(command, open))
    if (!/\bscope\b/.test(columns)) violations.push(`a unique index without scope: (${columns})`)
  }
  return violations
}

/** Every rule `text` breaks, one line each; empty when it keeps to all of them. */
export function citusViolations (text: string): string[] {
  const sql = normalize(text)
  const violations: string[] = []
  const commands = sql.split(';').map((command) => command.trim()).filter((command) => command !== '')
  const ddl = commands.filter((command) => /^(?:create|alter|drop|comment|grant|revoke)\b/.test(command))
  // Read from the text itself: normalize() blanks the setting's name, a string literal.
  for (const [, setting] of text.matchAll(/\bset_config\s*\(\s*([^,)]*)/gi)) {
    if (setting?.trim() !== `'${MARK_SETTING}'`) violations.push('set_config(…): Citus forwards SET LOCAL to the workers, not a function call')
  }
  if (commands.length > 1 && ddl.length > 0) violations.push(`DDL in a text of ${commands.length} commands: ${ddl[0]}`)
  for (const command of commands) {
    if (/\bctid\b/.test(command)) violations.push('a ctid')
    if (/\bskip locked\b/.test(command)) violations.push('SKIP LOCKED')
    if (/\bfor (?:update|no key update|share|key share)\b/.test(command) && !SCOPE_BOUND.test(command)) {
      violations.push('a row lock without scope = $n')
    }
    violations.push(...ddlViolations(command))
    for (const part of parts(command)) violations.push(...writingPartViolations(part))
  }
  return violations
}
