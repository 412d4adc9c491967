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
      'no-void': ['error', { allowAsStatement: true }],
      // A loop that awaits sees flags that other async functions flip meanwhile (close() sets
      // `closed` while a purge batch runs); the rule reads only the loop's own body.
      'no-unmodified-loop-condition': 'off'
    }
  },
  {
    files: ['**/*.ts'],
    rules: {
      // `_`-prefixed names are deliberately unused: a destructured property left out of a rest
      // object, a callback's parameter.
      '@typescript-eslint/no-unused-vars': ['error', { argsIgnorePattern: '^_', varsIgnorePattern: '^_', ignoreRestSiblings: true }]
    }
  }
]
