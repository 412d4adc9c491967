/**
 * The parsers of the column types the driver's statements return, given to every query it sends
 * through node-postgres (the query config's `types`), so that an application's own global
 * `pg.types.setTypeParser(…)` (timestamps as strings, say) never changes what the store reads.
 * Results are in the text format; anything else is handed over as its text.
 */

const OID = { bool: 16, bytea: 17, int4: 23, text: 25, float8: 701, timestamptz: 1184, uuid: 2950, jsonb: 3802 } as const

type Parser = (text: string) => unknown

const parsers = new Map<number, Parser>([
  [OID.bool, (text) => text === 't' || text === 'true'],
  [OID.bytea, parseBytea],
  [OID.int4, (text) => Number.parseInt(text, 10)],
  // Number() reads 'Infinity', '-Infinity' and 'NaN' as PostgreSQL writes them.
  [OID.float8, (text) => Number(text)],
  [OID.timestamptz, parseTimestamp],
  [OID.jsonb, (text) => JSON.parse(text)]
])

const asText: Parser = (text) => text

export const nodePostgresTypes = Object.freeze({
  getTypeParser (oid: number): Parser {
    return parsers.get(oid) ?? asText
  }
})

/** `bytea_output = hex` (the default since PostgreSQL 9.0) or `escape`. */
function parseBytea (text: string): Buffer {
  if (text.startsWith('\\x')) return Buffer.from(text.slice(2), 'hex')
  const bytes: number[] = []
  for (let i = 0; i < text.length; i++) {
    if (text[i] !== '\\') {
      bytes.push(text.charCodeAt(i))
    } else if (text[i + 1] === '\\') {
      bytes.push(0x5c)
      i++
    } else {
      bytes.push(Number.parseInt(text.slice(i + 1, i + 4), 8))
      i += 3
    }
  }
  return Buffer.from(bytes)
}

/**
 * ISO DateStyle, as the server sends it to a client that did not change it: `2026-12-02
 * 00:38:46.742123+00`, an offset in hours (and minutes, seconds for some historic zones).
 * 'infinity' has no Date; the statements never return one to be parsed.
 */
export function parseTimestamp (text: string): Date {
  const match = /^(\d{4,})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?([+-])(\d\d)(?::(\d\d))?(?::(\d\d))?( BC)?$/.exec(text)
  if (match === null) return new Date(Number.NaN)
  const [, year, month, day, hour, minute, second, fraction = '0', sign, offsetHours, offsetMinutes = '0', offsetSeconds = '0', bc] = match
  const y = bc === undefined ? Number(year) : 1 - Number(year)
  const utc = Date.UTC(y, Number(month) - 1, Number(day), Number(hour), Number(minute), Number(second), Number(fraction.padEnd(3, '0').slice(0, 3)))
  const offsetMs = (Number(offsetHours) * 3600 + Number(offsetMinutes) * 60 + Number(offsetSeconds)) * 1000
  const date = new Date(utc - (sign === '-' ? -offsetMs : offsetMs))
  // Date.UTC reads years 0-99 as 1900-1999.
  if (y >= 0 && y < 100) date.setUTCFullYear(date.getUTCFullYear() - 1900)
  return date
}
