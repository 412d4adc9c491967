import { InvalidOptionError } from './errors.js'

/**
 * The URL a request goes to, refused before anything is sent when it would leave `baseUrl`.
 *
 * The client sends credentials (`headers`) and an operation (body and key) to wherever a path
 * resolves, so a path taken from input must not be able to name another server or another API on
 * the same server. WHATWG URL parsing (which `fetch` uses) reads `//host`, `\\host` and `/\host`
 * as another authority for http(s) (URL Standard, "special authority slashes" treats `\` as `/`),
 * strips tabs and newlines anywhere (`/\t/host` is `//host`), and resolves `..` and `%2e%2e`
 * segments (RFC 3986 §5.2.4); so the check is made on what the parser resolved, not on the text:
 * the same origin as `baseUrl` and a path inside its path prefix.
 */
export function resolveUrl (baseUrl: URL | null, path: unknown): string {
  if (baseUrl === null) {
    const url = typeof path === 'string' && URL.canParse(path) ? new URL(path) : path instanceof URL ? path : null
    if (url === null || !isHttp(url)) throw new InvalidOptionError('path', 'an absolute http(s) URL (no baseUrl is set)', path)
    return url.href
  }
  if (typeof path === 'string') checkPathText(baseUrl, path)
  // A leading `/` means "from baseUrl", not "from the origin's root": '/payments' → /v1/payments.
  const relative = typeof path === 'string' ? path.replace(/^\//, '') : path
  const url = typeof relative === 'string' && URL.canParse(relative, baseUrl.href)
    ? new URL(relative, baseUrl)
    : relative instanceof URL ? relative : null
  if (url === null || !isHttp(url)) throw new InvalidOptionError('path', 'a path or an http(s) URL', path)
  if (url.origin !== baseUrl.origin) refuse(baseUrl, path, `it resolves to another origin (${url.origin})`)
  if (!url.pathname.startsWith(baseUrl.pathname)) refuse(baseUrl, path, `it resolves outside the baseUrl's path (${url.pathname})`)
  if (climbsOnceDecoded(url.pathname)) {
    refuse(baseUrl, path, 'it holds an encoded dot segment or separator (%2e, %2f, %5c) that climbs once a server decodes it')
  }
  return url.href
}

/**
 * Text the parser would read as another host, or would silently rewrite: refused as written, so the
 * error says why rather than where the parser happened to land.
 */
function checkPathText (baseUrl: URL, path: string): void {
  // The parser strips C0 controls and spaces at either end and tabs/newlines anywhere (URL Standard,
  // basic URL parser): `/\t/evil.example` would become `//evil.example`.
  // eslint-disable-next-line no-control-regex -- control characters are what this refuses
  if (/[\x00-\x1f\x7f]/.test(path) || path.startsWith(' ') || path.endsWith(' ')) {
    refuse(baseUrl, path, 'it holds control characters or surrounding spaces, which URL parsers strip or rewrite')
  }
  // Two leading separators, in any mix of `/` and `\`, are a scheme-relative reference to a host; a
  // leading `\` is one in every parser that treats it as `/`.
  if (/^[/\\]{2}/.test(path) || path.startsWith('\\')) {
    refuse(baseUrl, path, 'it starts with "//" or a backslash, which URL parsers read as another host')
  }
}

/**
 * A server or proxy that decodes `%2F`/`%5C` into separators before normalising (many do) would
 * climb over a segment the client's parser kept as text (`..%2Fadmin`): refused if the path, so
 * decoded, holds a `.` or `..` segment.
 */
function climbsOnceDecoded (pathname: string): boolean {
  if (!/%(?:2e|2f|5c)/i.test(pathname)) return false
  const decoded = pathname.replace(/%2e/gi, '.').replace(/%2f/gi, '/').replace(/%5c/gi, '\\')
  return decoded.split(/[/\\]/).some((segment) => segment === '.' || segment === '..')
}

function refuse (baseUrl: URL, path: unknown, why: string): never {
  throw new InvalidOptionError('path', `a path inside baseUrl ${baseUrl.href} (${why})`, path)
}

function isHttp (url: URL): boolean {
  return url.protocol === 'http:' || url.protocol === 'https:'
}
