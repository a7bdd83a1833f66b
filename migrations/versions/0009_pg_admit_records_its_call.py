"""kvgate_admit records its call on the tenant's lease row, so that a gateway whose
reply was lost can tell whether the call committed and give back what it took

An admission call can commit and its reply still never arrive (the connection drops
after the commit). The gateway then answered its requests with an error, yet the
counters held their slots, tokens and spend until that gateway restarted. Now each call
carries an id; the function writes it and the batch indices it admitted on the calling
gateway's lease row of the tenant (one more column on a row it writes anyway). Before
its next call for that tenant, the gateway reads the row under the tenant's advisory
lock: if its lost call is there, it settles each request it admitted as unused
(gateway/quota/postgres.py). SQLite keeps its counters in memory and gets the columns
only to keep one schema.

Revision ID: 0009
Revises: 0008
"""

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# as 0008's, with call_id: written with the admitted batch indices (a JSON array)
ADMIT = """
CREATE OR REPLACE FUNCTION kvgate_admit(lock_key text, batch jsonb, instance text,
                                        now_s double precision, call_id bigint)
RETURNS jsonb
LANGUAGE plpgsql AS $fn$
DECLARE
  req jsonb;
  rw jsonb;
  cur bigint;
  refused jsonb;
  taken jsonb;
  results jsonb := '[]'::jsonb;
  admitted jsonb := '[]'::jsonb;
  i integer := -1;
BEGIN
  PERFORM pg_advisory_xact_lock(hashtext(lock_key));
  PERFORM 1 FROM quota_counters AS c
  JOIN (SELECT DISTINCT r.value->>0 AS owner, r.value->>1 AS kind,
               (r.value->>2)::bigint AS win
        FROM jsonb_array_elements(batch) AS q,
             jsonb_array_elements(q.value->'rows') AS r) AS d
    ON c.tenant_id = d.owner AND c.kind = d.kind AND c."window" = d.win
  ORDER BY c.tenant_id, c.kind, c."window" FOR UPDATE OF c;
  FOR req IN SELECT e.value FROM jsonb_array_elements(batch) AS e LOOP
    i := i + 1;
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
    admitted := admitted || to_jsonb(i);
  END LOOP;
  IF admitted <> '[]'::jsonb THEN  -- the tenant's own lease row, written just above
    UPDATE quota_leases SET last_call = call_id, last_admitted = admitted::text
    WHERE instance_id = instance AND tenant_id = lock_key;
  END IF;
  RETURN results;
END
$fn$;
"""


def _revision_0008() -> ModuleType:
    """0008's module, whose function a downgrade puts back (its file name is no module
    name Python can import)."""
    path = Path(__file__).with_name("0008_pg_admit_locks_batch_first.py")
    spec = importlib.util.spec_from_file_location("kvgate_migration_0008", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    with op.batch_alter_table("quota_leases") as batch:
        batch.add_column(sa.Column("last_call", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("last_admitted", sa.Text(), nullable=True))
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION IF EXISTS kvgate_admit(text, jsonb, text, double precision)")
    op.execute(ADMIT)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "DROP FUNCTION IF EXISTS kvgate_admit(text, jsonb, text, double precision, bigint)"
        )
        op.execute(_revision_0008().ADMIT)
    with op.batch_alter_table("quota_leases") as batch:
        batch.drop_column("last_admitted")
        batch.drop_column("last_call")
