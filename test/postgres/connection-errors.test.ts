import t from 'tap'
import { connectionState, isConnectionError } from '../../drivers/postgres/dropped-connection.js'
import { isNodePostgresConnectionError } from '../../drivers/postgres/node-postgres.js'

/**
 * Which errors tell the Postgres driver that a transaction's connection is gone (after which it
 * sends nothing more on it, and never reuses it), for each client; and the connection state that
 * records it: the first loss wins, and whoever asks later hears of it at once.
 */

const systemError = (syscall: string, code: string): Error => Object.assign(new Error(`${syscall} ${code}`), { syscall, code })
const serverError = (name: string, severity: string, code: string): Error => Object.assign(new Error('server said'), { name, severity, code })

t.test('postgres.js: its connection codes, a socket\'s error, a FATAL or PANIC from the server', async (t) => {
  for (const code of ['CONNECTION_CLOSED', 'CONNECTION_DESTROYED', 'CONNECTION_ENDED', 'CONNECT_TIMEOUT']) {
    t.equal(isConnectionError(Object.assign(new Error(code), { code })), true, code)
  }
  t.equal(isConnectionError(systemError('read', 'ECONNRESET')), true, 'a socket error')
  t.equal(isConnectionError(serverError('PostgresError', 'FATAL', '57P01')), true, 'terminated by an administrator')
  t.equal(isConnectionError(serverError('PostgresError', 'PANIC', 'XX000')), true, 'a PANIC')
  t.equal(isConnectionError(serverError('PostgresError', 'ERROR', '40001')), false, 'a serialization failure: the session lives on')
  t.equal(isConnectionError(Object.assign(new Error('unique'), { code: '23505' })), false, 'another code')
  t.equal(isConnectionError(new Error('fetch failed')), false, 'a plain error')
  for (const value of [null, undefined, 'ECONNRESET', 57]) t.equal(isConnectionError(value), false, `not an object: ${String(value)}`)
})

t.test('node-postgres: its own messages, a socket\'s error, the SQLSTATEs and severities of an ended session', async (t) => {
  for (const message of ['Connection terminated unexpectedly', 'Connection terminated', 'Client was closed and is not queryable', 'Query read timeout']) {
    t.equal(isNodePostgresConnectionError(new Error(message)), true, message)
  }
  t.equal(isNodePostgresConnectionError(systemError('write', 'EPIPE')), true, 'a socket error')
  t.equal(isNodePostgresConnectionError(serverError('error', 'FATAL', '57P01')), true, 'FATAL')
  t.equal(isNodePostgresConnectionError(serverError('error', 'PANIC', 'XX000')), true, 'PANIC')
  // lc_messages may translate the severity; the SQLSTATE says the same in every language.
  for (const code of ['57P01', '57P02', '57P03', '08006', '08P01', '25P03']) {
    t.equal(isNodePostgresConnectionError(serverError('error', 'SCHWERWIEGEND', code)), true, `${code}, severity localized`)
  }
  for (const code of ['57P04', '57014', '40001', '23505']) {
    t.equal(isNodePostgresConnectionError(serverError('error', 'ERROR', code)), false, `${code}: the session lives on`)
  }
  t.equal(isNodePostgresConnectionError(new Error('relation "x" does not exist')), false, 'another message')
  for (const value of [null, undefined, 'Connection terminated', 8]) t.equal(isNodePostgresConnectionError(value), false, `not an object: ${String(value)}`)
})

t.test('the connection state: the first loss wins, and a listener registered after it hears of it at once', async (t) => {
  const connection = connectionState()
  t.equal(connection.lost, null)
  const heard: unknown[] = []
  connection.onLost((err) => heard.push(['early', err]))
  const first = new Error('first')
  connection.lose(first)
  connection.lose(new Error('second'))
  t.equal(connection.lost, first, 'the first error is kept')
  connection.onLost((err) => heard.push(['late', err]))
  t.same(heard, [['early', first], ['late', first]], 'each listener told once, the late one at once')

  const unexplained = connectionState()
  unexplained.lose(undefined)
  t.match(unexplained.lost, { message: 'connection lost' }, 'a loss without an error still reads as one')
})
