import Fastify from 'fastify'
import http from 'node:http'
import idempotency from '../lib/index.js'
process.on('unhandledRejection', (e) => { console.log('UNHANDLED', (e as Error).message) })
for (const withPlugin of [false, true]) {
  const app = Fastify()
  if (withPlugin) await app.register(idempotency, { scope: () => 's' })
  app.post('/crlf', async (_r, reply) => { reply.header('content-disposition', 'attachment; filename="a\r\nb"'); return { ok: 1 } })
  app.post('/euro', async (_r, reply) => { reply.header('content-disposition', 'attachment; filename="€"'); return { ok: 1 } })
  app.post('/name', async (_r, reply) => { reply.header('x bad', 'v'); return { ok: 1 } })
  app.post('/payload', async (_r, reply) => { reply.type('application/json').serializer(() => 42 as unknown as string); return { ok: 1 } })
  app.post('/ok', async () => ({ fine: true }))
  await app.listen({ port: 0, host: '127.0.0.1' })
  const port = (app.server.address() as any).port
  const call = (path: string, key: string) => new Promise<string>((resolve) => {
    const req = http.request({ host: '127.0.0.1', port, method: 'POST', path, headers: { 'content-type': 'application/json', 'idempotency-key': `"${key}"` } }, (res) => { let b = ''; res.on('data', (c) => b += c); res.on('end', () => resolve(`${res.statusCode} ${b}`)) })
    req.on('error', (e) => resolve('ERR ' + e.message))
    setTimeout(() => { req.destroy(); resolve('TIMEOUT') }, 1500).unref()
    req.end('{}')
  })
  for (const p of ['/crlf', '/euro', '/name', '/payload', '/ok']) console.log(withPlugin, p, await call(p, 'k' + p), '| again:', await call(p, 'k' + p))
  await app.close()
}
