from __future__ import annotations

import pytest

from gateway.config import SQLITE_WAL_LIMIT_BYTES
from gateway.config_load import load_settings


def test_toml_env_and_flags_layer(tmp_path):
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(
        """
[server]
port = 9000
host = "0.0.0.0"

[[backends]]
name = "a"
type = "fake"
served_model_name = "model-a"
tokens_per_second = 50

[[backends]]
name = "b"
type = "fake"
served_model_name = "model-b"
options = { ttft_ms = 5 }
"""
    )
    s = load_settings(cfg, environ={"KVGATE_PORT": "9100"})
    assert s.port == 9100 and s.host == "0.0.0.0"
    a, b = s.resolved_backends()
    assert (a.name, a.served_model_name, a.options) == ("a", "model-a", {"tokens_per_second": 50})
    assert b.options == {"ttft_ms": 5}
    s = load_settings(cfg, overrides={"port": 9200, "backend": "fake"}, environ={})
    assert s.port == 9200
    assert [x.type for x in s.resolved_backends()] == ["fake"]


def test_bad_config_is_a_clear_error(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[[backends]]\ntype = 'fake'\n")
    with pytest.raises(ValueError, match="needs 'name'"):
        load_settings(cfg, environ={})
    cfg.write_text("[server]\nprot = 1\n")
    with pytest.raises(ValueError, match="prot"):
        load_settings(cfg, environ={})


def test_fairness_reaches_gpu_entries_that_do_not_choose_their_own(tmp_path):
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(
        """
[[backends]]
name = "a"
type = "gpu"
model = "m"

[[backends]]
name = "b"
type = "gpu"
model = "m"
options = { fairness = "vtc" }

[[backends]]
name = "c"
type = "fake"
"""
    )
    a, b, c = load_settings(cfg, overrides={"fairness": "fcfs"}, environ={}).resolved_backends()
    assert a.options == {"fairness": "fcfs"}
    assert b.options == {"fairness": "vtc"}  # the entry's own choice wins
    assert c.options == {}
    a, b, c = load_settings(cfg, environ={}).resolved_backends()
    assert a.options == {} and b.options == {"fairness": "vtc"}


def test_engine_flags_beside_backend_entries_are_an_error_not_ignored(tmp_path):
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text('[[backends]]\nname = "a"\ntype = "fake"\n')
    for overrides, named in (({"replicas": 2}, "replicas"), ({"n_ctx": 4096}, "n_ctx")):
        settings = load_settings(cfg, overrides=overrides, environ={})
        with pytest.raises(ValueError, match=f"'{named}'.*set them in an entry's options"):
            settings.resolved_backends()
    assert load_settings(cfg, overrides={"replicas": 1}, environ={}).resolved_backends()


def test_sqlite_wal_limit_is_a_setting(tmp_path):
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text("[server]\nsqlite_wal_limit_bytes = 1048576\n")
    assert load_settings(environ={}).sqlite_wal_limit_bytes == SQLITE_WAL_LIMIT_BYTES == 2**24
    assert load_settings(cfg, environ={}).sqlite_wal_limit_bytes == 2**20
    env = {"KVGATE_SQLITE_WAL_LIMIT_BYTES": "262144"}
    assert load_settings(cfg, environ=env).sqlite_wal_limit_bytes == 2**18


@pytest.mark.parametrize("name", ["admin_key", "kv_tier_secret"])
def test_a_secret_of_the_wrong_type_is_named_not_shown(tmp_path, name):
    cfg = tmp_path / "kvgate.toml"
    secret = 918273645546372819918273645546372819
    cfg.write_text(f"[server]\n{name} = {secret}\n\n[[backends]]\nname = 'a'\ntype = 'fake'\n")
    with pytest.raises(ValueError, match=name) as refused:
        load_settings(cfg, environ={})
    assert str(secret) not in str(refused.value)
    assert "a value of type int" in str(refused.value)
