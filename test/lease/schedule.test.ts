import t from 'tap'
import { Schedule, type Scheduled } from '../../lib/core/schedule.js'
import { sleep } from '../helpers/sleep.js'

/** The shared deadlines behind store-call timeouts and lease renewals (lib/core/schedule.ts). */

class Item implements Scheduled {
  dueAt = 0
  previous: Scheduled | null = null
  next: Scheduled | null = null
  scheduled = false
  constructor (readonly name: string) {}
}

const timers = (): number => process.getActiveResourcesInfo().filter((resource) => resource === 'Timeout').length

t.test('items fall due in the order they were added, each after the delay; a removed item never does', async (t) => {
  const due: Array<[string, number]> = []
  const started = performance.now()
  const schedule = new Schedule<Item>(50, (item) => { due.push([item.name, performance.now() - started]) }, true)
  const a = new Item('a')
  const b = new Item('b')
  const c = new Item('c')
  schedule.add(a)
  await sleep(20)
  schedule.add(b)
  schedule.add(c)
  schedule.remove(b)
  schedule.remove(b) // a no-op the second time
  await sleep(120)
  t.same(due.map(([name]) => name), ['a', 'c'])
  t.ok((due[0]?.[1] ?? 0) >= 49, `a fell due after its delay (${due[0]?.[1].toFixed(0)} ms)`)
  t.ok((due[1]?.[1] ?? 0) >= 69, `c, added 20 ms later, 20 ms later (${due[1]?.[1].toFixed(0)} ms)`)
  t.equal(a.scheduled || b.scheduled || c.scheduled, false, 'nothing is left scheduled')
})

t.test('an item re-added from its own due callback waits a whole delay again', async (t) => {
  let runs = 0
  const schedule: Schedule<Item> = new Schedule<Item>(30, (item) => { if (++runs < 3) schedule.add(item) }, true)
  schedule.add(new Item('again'))
  await sleep(20)
  t.equal(runs, 0)
  await sleep(100)
  t.equal(runs, 3)
})

t.test('a schedule keeps the process alive only while items wait, with one timer however many come and go', async (t) => {
  const before = timers()
  const schedule = new Schedule<Item>(10_000, () => {}, true)
  const items = [new Item('x'), new Item('y')]
  for (const item of items) schedule.add(item)
  t.equal(timers(), before + 1, 'one timer, holding the process, for both items')
  schedule.remove(items[0] as Item)
  t.equal(timers(), before + 1, 'still holding it while an item waits')
  schedule.remove(items[1] as Item)
  t.equal(timers(), before, 'no longer once empty')
  schedule.add(items[0] as Item)
  t.equal(timers(), before + 1, 'the same timer holds it again')
  schedule.remove(items[0] as Item)
  const lone = new Schedule<Item>(10_000, () => {}, false)
  lone.add(new Item('z'))
  t.equal(timers(), before, 'a schedule made not to keep the process alive never does')
})

t.test('drain takes every waiting item out, in order, and none of them falls due afterwards', async (t) => {
  const due: string[] = []
  const schedule = new Schedule<Item>(30, (item) => { due.push(item.name) }, false)
  const items = [new Item('a'), new Item('b'), new Item('c')]
  for (const item of items) schedule.add(item)
  schedule.remove(items[1] as Item)
  const drained: string[] = []
  schedule.drain((item) => { drained.push(item.name) })
  t.same(drained, ['a', 'c'])
  t.equal(items.some((item) => item.scheduled), false, 'nothing is left scheduled')
  schedule.drain(() => { t.fail('an empty schedule has nothing to drain') })
  await sleep(60)
  t.same(due, [], 'a drained item never falls due')
  schedule.add(items[1] as Item)
  await sleep(60)
  t.same(due, ['b'], 'the schedule still works after a drain')
})
