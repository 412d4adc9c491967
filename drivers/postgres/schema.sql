-- fastify-idempotency: the Postgres driver's tables, with the default names, for migration tools.
-- The same DDL as `migrate(sql)` (drivers/postgres/schema.ts), and a test checks that both produce
-- the same tables. Idempotent: safe to apply twice, and to apply again after an upgrade (it adds
-- what a newer version needs). Unqualified names: it creates the tables in the first schema of the
-- search_path (public by default). For another schema, run `SET search_path TO <schema>` first
-- and pass `{ schema: '<schema>' }` to postgresStore().
--
-- Apply it statement by statement. `psql -v ON_ERROR_STOP=1 -f schema.sql` does: psql sends each
-- statement by itself. So does any tool that splits the file at every semicolon: a semicolon ends
-- each statement and appears nowhere else in this file, comments included, and a test applies the
-- file split exactly that way. A tool that sends the whole file as ONE query works on plain
-- PostgreSQL but not on Citus once the tables are distributed: Citus propagates the ALTER TABLE
-- and a new CREATE INDEX to the workers, and a worker refuses them when they came in a text of
-- several commands ("cannot insert multiple commands into a prepared statement"). migrate() sends
-- one statement at a time and works on distributed tables too.
--
-- On Citus, distribute the tables by scope after the first application:
--   SELECT create_distributed_table('idempotency_records', 'scope')
--   SELECT create_distributed_table('idempotency_records_outbox', 'scope', colocate_with => 'idempotency_records')
-- A table is distributed once, not again on upgrades. A table an upgrade creates stays a plain
-- table on the coordinator until it is distributed: after the upgrade that adds the outbox to an
-- existing records table, run the second line.

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

-- The transactional outbox, keyed like the records (scope first, for co-location on Citus).
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
