"""quota admission and settlement as PostgreSQL functions: one round trip each

Admission of a batch of one tenant's requests is one call of `kvgate_admit`, in
autocommit: it takes the tenant's advisory lock, then admits the requests one after
another (each all of its counters or none), so a batch is exact as N single admissions
are. Settlement is one call of `kvgate_settle` inside the usage rows' group commit.
Both take counter rows in (owner, kind, window) order, the one order every writer of
quota_counters uses, so that no two transactions can deadlock on them.
SQLite has no functions: its quota counters live in the gateway's memory.

Revision ID: 0007
Revises: 0006
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# batch: [{"rows": [[owner, kind, window, amount, limit | null], ...] in order,
#          "leases": [[owner, slots], ...]}, ...]
# returns, per request: {"taken": [[owner, kind, value], ...]} or
#                       {"refused": [owner, kind, used]}
ADMIT = """
CREATE OR REPLACE FUNCTION kvgate_admit(lock_key text, batch jsonb, instance text,
                                        now_s double precision) RETURNS jsonb
LANGUAGE plpgsql AS $fn$
DECLARE
  req jsonb;
  rw jsonb;
  cur bigint;
  refused jsonb;
  taken jsonb;
  results jsonb := '[]'::jsonb;
BEGIN
  PERFORM pg_advisory_xact_lock(hashtext(lock_key));
  FOR req IN SELECT e.value FROM jsonb_array_elements(batch) AS e LOOP
    refused := NULL;
    FOR rw IN SELECT e.value FROM jsonb_array_elements(req->'rows') AS e LOOP
      CONTINUE WHEN jsonb_typeof(rw->4) = 'null';
      SELECT c.value INTO cur FROM quota_counters AS c
        WHERE c.tenant_id = rw->>0 AND c.kind = rw->>1 AND c."window" = (rw->>2)::bigint;
      cur := coalesce(cur, 0);
      IF cur + (rw->>3)::bigint > (rw->>4)::bigint THEN
        refused := jsonb_build_array(rw->>0, rw->>1, cur);
        EXIT;
      END IF;
    END LOOP;
    IF refused IS NOT NULL THEN
      results := results || jsonb_build_array(jsonb_build_object('refused', refused));
      CONTINUE;
    END IF;
    WITH up AS (
      INSERT INTO quota_counters AS c (tenant_id, kind, "window", value, limit_value)
      SELECT e.value->>0, e.value->>1, (e.value->>2)::bigint, (e.value->>3)::bigint,
             (e.value->>4)::bigint
      FROM jsonb_array_elements(req->'rows') WITH ORDINALITY AS e(value, n) ORDER BY e.n
      ON CONFLICT (tenant_id, kind, "window") DO UPDATE
        SET value = c.value + excluded.value, limit_value = excluded.limit_value
      RETURNING c.tenant_id, c.kind, c.value
    )
    SELECT jsonb_agg(jsonb_build_array(up.tenant_id, up.kind, up.value)) INTO taken FROM up;
    INSERT INTO quota_leases AS l (instance_id, tenant_id, held, heartbeat)
    SELECT instance, e.value->>0, (e.value->>1)::bigint, now_s
    FROM jsonb_array_elements(req->'leases') AS e
    ON CONFLICT (instance_id, tenant_id) DO UPDATE
      SET held = l.held + excluded.held, heartbeat = excluded.heartbeat;
    results := results || jsonb_build_array(jsonb_build_object('taken', taken));
  END LOOP;
  RETURN results;
END
$fn$;
"""

# deltas: [[owner, kind, window, delta], ...]; leases: [[owner, slots given back], ...]
SETTLE = """
CREATE OR REPLACE FUNCTION kvgate_settle(deltas jsonb, leases jsonb, instance text)
RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
  PERFORM 1 FROM quota_counters AS c
  JOIN (SELECT DISTINCT e.value->>0 AS owner, e.value->>1 AS kind, (e.value->>2)::bigint AS win
        FROM jsonb_array_elements(deltas) AS e) AS d
    ON c.tenant_id = d.owner AND c.kind = d.kind AND c."window" = d.win
  ORDER BY c.tenant_id, c.kind, c."window" FOR UPDATE OF c;
  UPDATE quota_counters AS c SET value = c.value + d.delta
  FROM (SELECT e.value->>0 AS owner, e.value->>1 AS kind, (e.value->>2)::bigint AS win,
               sum((e.value->>3)::bigint) AS delta
        FROM jsonb_array_elements(deltas) AS e GROUP BY 1, 2, 3) AS d
  WHERE c.tenant_id = d.owner AND c.kind = d.kind AND c."window" = d.win AND d.delta <> 0;
  UPDATE quota_leases AS l SET held = l.held - s.slots
  FROM (SELECT e.value->>0 AS owner, sum((e.value->>1)::bigint) AS slots
        FROM jsonb_array_elements(leases) AS e GROUP BY 1) AS s
  WHERE l.instance_id = instance AND l.tenant_id = s.owner;
END
$fn$;
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(ADMIT)
    op.execute(SETTLE)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION IF EXISTS kvgate_settle(jsonb, jsonb, text)")
    op.execute("DROP FUNCTION IF EXISTS kvgate_admit(text, jsonb, text, double precision)")
