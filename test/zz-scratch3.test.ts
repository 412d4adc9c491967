import t from 'tap'
t.test('slow', async t => { await new Promise(r => setTimeout(r, 60000)); t.pass() })
