/**
 * The chart of docs/benchmarks-chart.svg, drawn from the summary's `load` section (summary-file.ts):
 * hand-built SVG, one group of bars per scenario, one bar per setup, its height the setup's req/s
 * over bare's (medians of slice pairs), bare the dashed line at 1.0. `npm run bench` redraws it;
 * `npm run bench:chart [-- summary.json chart.svg]` redraws it from a summary alone.
 */
import { writeFileSync } from 'node:fs'
import { fileURLToPath } from 'node:url'
import { readSummary, SUMMARY, type LoadSection } from './summary-file.js'

export const DOCS_CHART = fileURLToPath(new URL('../docs/benchmarks-chart.svg', import.meta.url))

const COLOURS: Record<string, string> = {
  bare: '#9e9e9e',
  memory: '#1f77b4',
  'peer-memory': '#aec7e8',
  'pg-lease': '#2ca02c',
  'pg-atomic': '#98df8a',
  'pg-redis': '#d62728',
  'pg-redis-unpipelined': '#f4a582',
  'peer-redis': '#ff9896',
  'floor-sql': '#7f7f7f',
  'floor-select': '#bcbd22',
  'floor-txn': '#8c564b'
}

const escapeXml = (text: string): string => text.replace(/[<>&"]/g, (c) => ({ '<': '&lt;', '>': '&gt;', '&': '&amp;', '"': '&quot;' })[c]!)

const describe = (payload: number, connections: number): string =>
  `${payload >= 1024 * 1024 ? `${Math.round(payload / 1024 / 1024)} MiB` : payload >= 1024 ? `${Math.round(payload / 1024)} KiB` : `~${payload} B`}, ${connections} conn.`

export function chart (load: LoadSection): string {
  const { environment: env } = load
  const main = load.scenarios.fresh ?? Object.values(load.scenarios)[0]
  const lines = [
    `${env.cores}-core ${env.cpu}; Node ${env.node.replace(/^v/, '')}, Fastify ${env.fastify}, PostgreSQL ${env.postgres} (postgres.js ${env.postgresClient}); POST with a JSON body schema`,
    `PostgreSQL durability: ${env.durability}`,
    `peer: @node-idempotency/core ${env.peer} (benchmarks/peer-glue.ts); all processes on one machine, ${env.pinned ? 'the load generator on a CPU of its own' : 'not pinned'}`
  ]
  const barW = 16
  const gap = 26
  const groups = Object.entries(load.scenarios).map(([name, { payload, connections, setups }]) => ({
    name,
    payload,
    connections,
    rows: Object.entries(setups).flatMap(([setup, f]) => setup === 'bare' || f.ratioTo.bare === undefined ? [] : [{ setup, ratioToBare: f.ratioTo.bare, requestsPerSecond: f.requestsPerSecond }])
  })).filter((group) => group.rows.length > 0)
  const groupWidths = groups.map(({ rows }) => Math.max(70, rows.length * barW + gap))
  const margin = { top: 110, right: 170, bottom: 70, left: 70 }
  const plotW = groupWidths.reduce((sum, w) => sum + w, 0)
  const width = Math.max(900, plotW + margin.left + margin.right)
  const height = 560
  const plotH = height - margin.top - margin.bottom
  const maxRatio = Math.max(1, ...groups.flatMap(({ rows }) => rows.map((row) => row.ratioToBare)))
  const top = Math.ceil(maxRatio * 5 + 0.5) / 5 // room for the labels above the tallest bar
  const step = top > 4 ? 0.5 : 0.2
  const y = (v: number): number => margin.top + plotH - v / top * plotH
  const out: string[] = []
  out.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" font-family="Helvetica, Arial, sans-serif">`)
  out.push(`<rect width="${width}" height="${height}" fill="#ffffff"/>`)
  out.push(`<text x="${margin.left}" y="26" font-size="17" font-weight="bold" fill="#222">Throughput relative to bare (req/s ÷ bare's in the same 1-second slice; median over ${main?.rounds ?? 0} round(s) × ${main?.slices ?? 0} slice(s))</text>`)
  lines.forEach((line, i) => out.push(`<text x="${margin.left}" y="${48 + 18 * i}" font-size="12" fill="#444">${escapeXml(line)}</text>`))
  // Grid and y axis.
  for (let v = 0; v <= top + 1e-9; v += step) {
    const yy = y(v).toFixed(1)
    out.push(`<line x1="${margin.left}" x2="${margin.left + plotW}" y1="${yy}" y2="${yy}" stroke="#e4e4e4"/>`)
    out.push(`<text x="${margin.left - 8}" y="${yy}" font-size="11" fill="#444" text-anchor="end" dominant-baseline="middle">${v.toFixed(1)}</text>`)
  }
  out.push(`<line x1="${margin.left}" x2="${margin.left}" y1="${margin.top}" y2="${margin.top + plotH}" stroke="#444"/>`)
  out.push(`<line x1="${margin.left}" x2="${margin.left + plotW}" y1="${margin.top + plotH}" y2="${margin.top + plotH}" stroke="#444"/>`)
  out.push(`<text transform="translate(20 ${margin.top + plotH / 2}) rotate(-90)" font-size="13" fill="#222" text-anchor="middle">req/s ÷ bare's req/s (same round)</text>`)
  // bare = 1.0, under the bars and their labels.
  out.push(`<line x1="${margin.left}" x2="${margin.left + plotW}" y1="${y(1).toFixed(1)}" y2="${y(1).toFixed(1)}" stroke="#555" stroke-dasharray="6 4"/>`)
  out.push(`<text x="${margin.left + plotW + 6}" y="${y(1).toFixed(1)}" font-size="11" fill="#555" dominant-baseline="middle">bare = 1.0</text>`)
  // Bars.
  let x0 = margin.left
  groups.forEach((group, g) => {
    const groupW = groupWidths[g]!
    const start = x0 + (groupW - group.rows.length * barW) / 2
    group.rows.forEach((row, i) => {
      const v = row.ratioToBare
      const x = start + i * barW
      out.push(`<rect x="${(x + 1).toFixed(1)}" y="${y(v).toFixed(1)}" width="${(barW - 2).toFixed(1)}" height="${(y(0) - y(v)).toFixed(1)}" fill="${COLOURS[row.setup]}"><title>${escapeXml(`${group.name} ${row.setup}: ${v.toFixed(2)}× bare, ${Math.round(row.requestsPerSecond)} req/s`)}</title></rect>`)
      const lx = (x + barW / 2).toFixed(1)
      const ly = (y(v) - 4).toFixed(1)
      out.push(`<text transform="translate(${lx} ${ly}) rotate(-90)" font-size="10" fill="#222" dominant-baseline="middle">${v.toFixed(2)}</text>`)
    })
    const cx = x0 + groupW / 2
    out.push(`<text x="${cx.toFixed(1)}" y="${margin.top + plotH + 20}" font-size="12" fill="#222" text-anchor="middle">${escapeXml(group.name)}</text>`)
    out.push(`<text x="${cx.toFixed(1)}" y="${margin.top + plotH + 36}" font-size="9" fill="#666" text-anchor="middle">${escapeXml(describe(group.payload, group.connections))}</text>`)
    x0 += groupW
  })
  out.push(`<text x="${margin.left + plotW / 2}" y="${height - 12}" font-size="13" fill="#222" text-anchor="middle">scenario</text>`)
  // Legend.
  const shown = Object.keys(COLOURS).filter((setup) => groups.some(({ rows }) => rows.some((row) => row.setup === setup)))
  const lx = margin.left + plotW + 20
  out.push(`<text x="${lx}" y="${margin.top + 10}" font-size="12" font-weight="bold" fill="#222">setup</text>`)
  shown.forEach((setup, i) => {
    const ly = margin.top + 26 + i * 22
    out.push(`<rect x="${lx}" y="${ly}" width="14" height="14" fill="${COLOURS[setup]}"/>`)
    out.push(`<text x="${lx + 20}" y="${ly + 7}" font-size="12" fill="#222" dominant-baseline="middle">${escapeXml(setup)}${setup.startsWith('peer-') ? ' (peer)' : ''}</text>`)
  })
  out.push('</svg>')
  return `${out.join('\n')}\n`
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const [from = SUMMARY, to = DOCS_CHART] = process.argv.slice(2)
  const { load } = readSummary(from)
  if (load === undefined) throw new Error(`${from} has no load section: run npm run bench first`)
  writeFileSync(to, chart(load))
  console.log(`wrote ${to}`)
}
