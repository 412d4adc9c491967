const MONTHS = ['jan', 'feb', 'mar', 'apr', 'may', 'jun', 'jul', 'aug', 'sep', 'oct', 'nov', 'dec']

const IMF_FIXDATE = /^(?:mon|tue|wed|thu|fri|sat|sun), (\d{2}) ([a-z]{3}) (\d{4}) (\d{2}):(\d{2}):(\d{2}) gmt$/
const RFC850_DATE = /^(?:monday|tuesday|wednesday|thursday|friday|saturday|sunday), (\d{2})-([a-z]{3})-(\d{2}) (\d{2}):(\d{2}):(\d{2}) gmt$/
const ASCTIME_DATE = /^(?:mon|tue|wed|thu|fri|sat|sun) ([a-z]{3}) ([ \d]\d) (\d{2}):(\d{2}):(\d{2}) (\d{4})$/

/**
 * An HTTP-date (RFC 9110 §5.6.7) in ms since the epoch, or `null`. All three formats are accepted,
 * as the RFC requires of recipients, and all are UTC: `Date.parse` would read the zoneless asctime
 * form in the local time zone. A two-digit rfc850 year more than 50 years ahead is the past century's.
 */
export function parseHttpDate (value: string, wallClock: () => number): number | null {
  const text = value.trim().toLowerCase()
  let match = IMF_FIXDATE.exec(text)
  if (match !== null) return utc(match[3], match[2], match[1], match[4], match[5], match[6])
  match = RFC850_DATE.exec(text)
  if (match !== null) {
    const thisYear = new Date(wallClock()).getUTCFullYear()
    let year = Math.floor(thisYear / 100) * 100 + Number(match[3])
    if (year > thisYear + 50) year -= 100
    return utc(String(year), match[2], match[1], match[4], match[5], match[6])
  }
  match = ASCTIME_DATE.exec(text)
  if (match !== null) return utc(match[6], match[1], match[2], match[3], match[4], match[5])
  return null
}

function utc (...parts: Array<string | undefined>): number | null {
  const [year, monthName, day, hour, minute, second] = parts
  const month = MONTHS.indexOf(monthName ?? '')
  const fields = [year, day, hour, minute, second].map((part) => Number(part?.trim()))
  const [y = NaN, d = NaN, h = NaN, mi = NaN, s = NaN] = fields
  if (month < 0 || d < 1 || d > 31 || h > 23 || mi > 59 || s > 60) return null
  return Date.UTC(y, month, d, h, mi, s)
}
