/** Every problem the plugin may answer (lib/http/problems.ts defines them, lib/http/profiles.ts shapes them). */
export type ProblemKind =
  | 'key-missing'
  | 'key-invalid'
  | 'key-reused'
  | 'request-in-progress'
  | 'store-unavailable'
  | 'response-not-retained'
  | 'not-committed'
  | 'outcome-unknown'
  | 'transaction-ended'
  | 'key-unknown'
  | 'body-too-deep'
  | 'body-too-large'
