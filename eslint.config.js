import neostandard from 'neostandard'

export default [
  ...neostandard({
    ts: true,
    ignores: ['dist/**', 'coverage/**', '.tap/**', 'test/orm/node_modules/**']
  }),
  {
    rules: {
      // `void promise` marks a promise whose outcome is handled elsewhere (its own catch, or a
      // settle that reports through the lifecycle): a statement, never a value.
      'no-void': ['error', { allowAsStatement: true }]
    }
  }
]
