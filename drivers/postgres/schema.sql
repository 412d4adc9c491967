-- fastify-idempotency: the Postgres driver's table, with the default names, for migration tools.
-- The same DDL as `migrate(sql)` (drivers/postgres/schema.ts); a test checks that both produce the
-- same table. Idempotent: safe to apply twice. Unqualified names: it creates the table in the first
-- schema of the search_path (public by default); for another schema, run
-- `SET search_path TO <schema>` first and pass `{ schema: '<schema>' }` to postgresStore().
-- On Citus, distribute by scope afterwards: SELECT create_distributed_table('idempotency_records', 'scope');

CREATE TABLE IF NOT EXISTS idempotency_records (
  scope                 text COLLATE "C" NOT NULL,
  key                   text COLLATE "C" NOT NULL,
  fingerprint           bytea NOT NULL,
  fingerprint_algorithm text NOT NULL,
  state                 text NOT NULL CHECK (state IN ('in_progress', 'completed')),
  owner_token           uuid NOT NULL,
  lease_expires_at      timestamptz,
  response_status       integer,
  response_headers      jsonb,
  response_body         bytea,
  created_at            timestamptz NOT NULL DEFAULT now(),
  expires_at            timestamptz NOT NULL,
  PRIMARY KEY (scope, key)
);

CREATE INDEX IF NOT EXISTS idempotency_records_expires_at_idx ON idempotency_records (expires_at);
