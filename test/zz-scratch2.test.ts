import t from 'tap'
t.test('fails', async t => { t.equal(1, 2) })
t.test('skipped', { skip: true }, async t => { t.pass() })
t.test('passes', async t => { t.pass() })
