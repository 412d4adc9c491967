import { spawn } from 'node:child_process'
import { fileURLToPath } from 'node:url'
import t from 'tap'

const root = fileURLToPath(new URL('../..', import.meta.url))

t.test('the demo (README\'s first command) creates exactly one charge per key under a retry storm', async (t) => {
  const output = await new Promise<{ code: number | null, stdout: string }>((resolve, reject) => {
    const child = spawn(process.execPath, ['--import', 'tsx', 'examples/demo.ts', '--payments', '8', '--senders', '10'], { cwd: root })
    let stdout = ''
    child.stdout.on('data', (chunk: Buffer) => { stdout += chunk.toString() })
    child.stderr.on('data', (chunk: Buffer) => { stdout += chunk.toString() })
    child.on('error', reject)
    child.on('close', (code) => resolve({ code, stdout }))
  })
  t.equal(output.code, 0, output.stdout)
  t.match(output.stdout, /charges created\s+│ 8 /)
  t.match(output.stdout, /answered by executing\s+│ 8 /)
  t.match(output.stdout, /key reused with another amount \(422\)\s+│ 8 /)
  t.match(output.stdout, /one charge per key: OK/)
})
