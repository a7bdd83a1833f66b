"""kvgate_admit locks every existing counter row of its batch first, in (owner, kind,
window) order, before it writes any

0007's function took each request's rows in turn, sorted within the request only: a batch
whose requests name different API keys could hold its tenant's rows and then wait for a
key's row (`key_...` sorts before `t_...`) that a settlement or a lease reclaim held while
waiting for the tenant's, and PostgreSQL would abort one of them. Taken all at once and in
the order every other writer uses, counter rows before lease rows, no cycle can form.
Rows the batch creates are not contended: only admissions insert them, and the tenant's
advisory lock lets one of its admissions run at a time. The rest of the function is 0007's.

Revision ID: 0008
Revises: 0007
"""

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# batch, instance, now_s and the result as in 0007
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
  PERFORM 1 FROM quota_counters AS c
  JOIN (SELECT DISTINCT r.value->>0 AS owner, r.value->>1 AS kind,
               (r.value->>2)::bigint AS win
        FROM jsonb_array_elements(batch) AS q,
             jsonb_array_elements(q.value->'rows') AS r) AS d
    ON c.tenant_id = d.owner AND c.kind = d.kind AND c."window" = d.win
  ORDER BY c.tenant_id, c.kind, c."window" FOR UPDATE OF c;
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


def _revision_0007() -> ModuleType:
    """0007's module, whose function a downgrade puts back (its file name is no module
    name Python can import)."""
    path = Path(__file__).with_name("0007_pg_quota_functions.py")
    spec = importlib.util.spec_from_file_location("kvgate_migration_0007", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(ADMIT)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(_revision_0007().ADMIT)
