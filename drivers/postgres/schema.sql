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
  steps                 jsonb NOT NULL DEFAULT '{}',
  indeterminate         boolean NOT NULL DEFAULT false,
  PRIMARY KEY (scope, key)
);

-- Upgrades a table created by an earlier version (no-op otherwise).
ALTER TABLE idempotency_records
  ADD COLUMN IF NOT EXISTS steps jsonb NOT NULL DEFAULT '{}',
  ADD COLUMN IF NOT EXISTS indeterminate boolean NOT NULL DEFAULT false;

CREATE INDEX IF NOT EXISTS idempotency_records_expires_at_idx ON idempotency_records (expires_at);

CREATE INDEX IF NOT EXISTS idempotency_records_in_progress_idx
  ON idempotency_records (lease_expires_at) WHERE state = 'in_progress';

-- The transactional outbox. On Citus: SELECT create_distributed_table('idempotency_records_outbox', 'scope', colocate_with => 'idempotency_records');
CREATE TABLE IF NOT EXISTS idempotency_records_outbox (
  scope           text COLLATE "C" NOT NULL,
  key             text COLLATE "C" NOT NULL,
  name            text COLLATE "C" NOT NULL,
  topic           text NOT NULL,
  payload         jsonb NOT NULL,
  delivery_key    text NOT NULL,
  created_at      timestamptz NOT NULL DEFAULT now(),
  next_attempt_at timestamptz NOT NULL DEFAULT now(),
  attempts        integer NOT NULL DEFAULT 0,
  last_error      text,
  delivered_at    timestamptz,
  PRIMARY KEY (scope, key, name)
);

CREATE INDEX IF NOT EXISTS idempotency_records_outbox_due_idx
  ON idempotency_records_outbox (next_attempt_at) WHERE delivered_at IS NULL;
