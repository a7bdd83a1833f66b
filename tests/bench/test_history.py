"""The history of `kvgate bench` runs: records written by real short runs against a
real `kvgate serve --backend fake`, listed by `bench history`, compared by `bench
compare` against the runs' own spread."""

import json

import pytest

from bench.cli import main
from bench.compare import compare_records
from bench.datasets import random_requests
from bench.history import find_record, load_records
from bench.serve import ServeConfig, serve_benchmark
from tests.conftest import start_gateway


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two `bench serve` runs of two rounds (outputs of 4, then 12 tokens) and a sweep,
    recorded in one results directory; the gateway's pid."""
    root = tmp_path_factory.mktemp("history")
    gw = start_gateway(root, "--backend", "fake")
    results = root / "results"
    try:
        key = gw.tenant_key("history")[1]
        base = ["--url", gw.url, "--api-key", key, "--num-prompts", "6", "--input-len", "8"]
        base += ["--ignore-eos", "--no-progress", "--results-dir", str(results)]
        for output_len in ("4", "12"):
            assert main(["serve", *base, "--output-len", output_len, "--rounds", "2"]) == 0
        sweep = ["sweep", *base, "--output-len", "4", "--concurrency", "1,2"]
        sweep += ["--save-result", str(root / "sweep.json"), "--plot", str(root / "sweep.png")]
        assert main(sweep) == 0
        yield results, gw.proc.pid, gw.url, key
    finally:
        gw.stop()


def test_records_hold_the_run(runs):
    results, server, _, _ = runs
    serve_a, serve_b, sweep = load_records(results)
    assert [r["kind"] for r in (serve_a, serve_b, sweep)] == ["serve", "serve", "sweep"]
    for r in (serve_a, serve_b):
        assert r["command"][:3] == ["kvgate", "bench", "serve"] and "--rounds" in r["command"]
        assert r["config"]["num_prompts"] == 6 and r["config"]["model"]
        assert r["version"]["commit"] and r["version"]["package"] == "0.1.0"
        assert r["hardware"]["cores"] >= 1 and r["hardware"]["cpu"]
        assert len(r["rounds"]) == 2
        figures = r["figures"]
        for name in ("output_throughput", "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms"):
            values = [round_[name] for round_ in r["rounds"]]
            assert figures[name] == pytest.approx(sum(values) / 2)  # median of two
            assert r["spread"][name] == pytest.approx(max(values) - min(values))
        assert figures["completed"] == 6 and figures["failed"] == 0
        # the gateway was found by its port: its resident memory on a CPU machine
        assert r["peak_memory"]["pid"] == server and r["peak_memory"]["kind"] == "rss"
        peaks = [round_["peak_rss_bytes"] for round_ in r["rounds"]]
        assert r["peak_memory"]["bytes"] == max(peaks) and min(peaks) > 10 << 20
    assert serve_a["config"]["output_len"] == 4 and serve_b["config"]["output_len"] == 12
    assert sweep["figures"]["levels.1"] == 2  # the sweep's saved numbers, flattened
    assert any(k.endswith("output_throughput") for k in sweep["figures"])


def test_history_lists_and_finds(runs, capsys):
    results, *_ = runs
    assert main(["history", "--results-dir", str(results)]) == 0
    lines = capsys.readouterr().out.splitlines()
    records = load_records(results)
    assert len(lines) == 1 + len(records)
    assert all(r["id"] in line for r, line in zip(records, lines[1:], strict=True))
    assert find_record("-1", results)["id"] == records[-1]["id"]
    assert find_record(records[0]["id"][:-2], results)["id"] == records[0]["id"]
    with pytest.raises(ValueError, match="no run"):
        find_record("nonexistent", results)


def test_compare_flags_changes_beyond_the_spread(runs, capsys):
    results, *_ = runs
    a, b = load_records(results)[:2]
    changes = {c.figure: c for c in compare_records(a, b)}
    for c in changes.values():
        spread = max(a["spread"][c.figure], b["spread"][c.figure])
        assert c.spread == spread and c.flagged == (abs(c.after - c.before) > spread)
    assert changes["completed"].delta == 0 and not changes["completed"].flagged
    # a run against itself changes nothing
    assert not any(c.flagged for c in compare_records(a, a))
    # their outputs differ in length: compared only when asked, and then said
    compare = ["compare", a["id"], b["id"], "--results-dir", str(results), "--json"]
    assert main([*compare, "--allow-different"]) == 0
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    assert (out["a"], out["b"]) == (a["id"], b["id"])
    assert out["different_workloads"] == [{"field": "output_len", "a": 4, "b": 12}]
    assert printed.err.startswith("WARNING") and "output_len: 4 in A, 12 in B" in printed.err
    assert {row["figure"] for row in out["changes"]} == set(changes)
    # a one-round sweep has no spread: its changes are shown, not judged
    sweep = load_records(results)[2]
    assert all(c.flagged is None for c in compare_records(sweep, sweep))
    assert main(["compare", "-1", "-1", "--results-dir", str(results)]) == 0
    assert "no spread to judge" in capsys.readouterr().out


def test_a_run_stops_when_asked(runs):
    """`abort_when` (kvgate tune's goal watch) ends a run: nothing more is sent, and the
    result holds what finished."""
    *_, url, key = runs
    seen = []

    def stop_after_two(out) -> bool:
        seen.append(out)
        return len(seen) == 2

    cfg = ServeConfig(url, None, [key], max_concurrency=1, show_progress=False)
    cfg.abort_when = stop_after_two
    result, _ = serve_benchmark(cfg, random_requests(6, 8, 4, 0.0, 0))
    assert result["completed"] == 2 and len(seen) == 2 and result["num_prompts"] == 6


def test_no_record_keeps_a_key(runs, tmp_path, monkeypatch, capsys):
    """Keys given every way (`--api-key K`, `--api-key=K`, a file, the environment, a
    second server's) reach the server, and no record on disk or printed holds one; the
    history directory, even one made open before, and its records are the owner's."""
    results, _, url, key = runs
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o755)
    (key_file := tmp_path / "keys").write_text(f"{key}\n")
    base = ["serve", "--url", url, "--num-prompts", "2", "--input-len", "8"]
    base += ["--output-len", "2", "--no-progress", "--results-dir", str(private)]
    assert main([*base, f"--api-key={key}"]) == 0
    assert main([*base, "--api-key-file", str(key_file)]) == 0
    monkeypatch.setenv("KVGATE_API_KEY", key)
    assert main(base) == 0
    monkeypatch.delenv("KVGATE_API_KEY")
    sweep = ["sweep", *base[1:], "--api-key", key, "--concurrency", "1", "--url2", url]
    sweep += [f"--api-key2={key}", "--save-result", str(tmp_path / "s.json")]
    assert main([*sweep, "--plot", str(tmp_path / "s.png")]) == 0
    records = load_records(private)
    assert [r["figures"]["completed"] for r in records[:3]] == [2, 2, 2]  # the keys worked
    assert records[0]["command"][-1] == "--api-key=<redacted>"
    assert records[3]["config"]["api_key"] == records[3]["config"]["api_key2"] == "<redacted>"
    command = records[3]["command"]
    assert command[command.index("--api-key") + 1] == "<redacted>"
    assert "--api-key2=<redacted>" in command
    assert private.stat().st_mode & 0o777 == 0o700
    for path in [*private.iterdir(), *results.iterdir()]:
        assert path.stat().st_mode & 0o777 == 0o600, path
        assert key not in path.read_text(), path
    for history in (["history"], ["history", "--json"]):
        assert main([*history, "--results-dir", str(private)]) == 0
        assert key not in capsys.readouterr().out


def test_a_key_an_older_record_kept_is_not_printed(runs, tmp_path, capsys):
    """Records written before keys were left out still hold them: read, they do not."""
    results, _, url, key = runs
    old = dict(load_records(results)[0], id="20200101T000000.000-serve-0ld")
    old["command"] = ["kvgate", "bench", "serve", "--api-key", key, f"--key-h={key}"]
    old["config"] = old["config"] | {"api_key": key, "url": f"http://me:{key}@host"}
    (tmp_path / f"{old['id']}.json").write_text(json.dumps(old))
    for argv in (["history"], ["history", "--json"], ["compare", "-1", "-1"]):
        assert main([*argv, "--results-dir", str(tmp_path)]) == 0
        assert key not in capsys.readouterr().out
    shown = find_record(str(tmp_path / f"{old['id']}.json"))
    assert shown["command"][3:] == ["--api-key", "<redacted>", "--key-h=<redacted>"]
    assert shown["config"]["url"] == "http://me:<redacted>@host"


def test_compare_refuses_runs_of_different_workloads(runs, tmp_path, capsys):
    """Runs of one workload compare as before; runs that differ (the prompts, the request
    shape, the server, the model, the kind of run) are refused with what differs named,
    or, asked for, compared under a warning that names it."""
    results, _, url, key = runs
    base = ["serve", "--url", url, "--api-key", key, "--num-prompts", "2", "--input-len", "8"]
    base += ["--output-len", "2", "--no-progress", "--results-dir", str(tmp_path)]
    for extra in ([], [], ["--seed", "1"], ["--endpoint", "chat"]):
        assert main([*base, *extra]) == 0
    same, again, seeded, chat = load_records(tmp_path)
    elsewhere = dict(same, id="20200101T000000.000-serve-else")
    elsewhere["config"] = same["config"] | {"url": "http://10.0.0.9:8000", "model": "other"}
    del elsewhere["config"]["temperature"]  # as a record of an older kvgate lacks it
    (tmp_path / f"{elsewhere['id']}.json").write_text(json.dumps(elsewhere))
    sweep = load_records(results)[2]
    capsys.readouterr()
    assert main(["compare", same["id"], again["id"], "--results-dir", str(tmp_path)]) == 0
    assert "WARNING" not in capsys.readouterr().out
    cases = [
        (seeded["id"], ["seed: 0 in A, 1 in B"]),
        (chat["id"], ['endpoint: "completions" in A, "chat" in B']),
        (elsewhere["id"], [f'url: "{url}" in A, "http://10.0.0.9:8000" in B']),
        (elsewhere["id"], ['model: "fake-model" in A, "other" in B']),
        (elsewhere["id"], ["temperature: 0.0 in A, not recorded in B"]),
        (str(results / f"{sweep['id']}.json"), ['kind of run: "serve" in A, "sweep" in B']),
    ]
    for other, named in cases:
        compare = ["compare", same["id"], other, "--results-dir", str(tmp_path)]
        assert main(compare) == 2
        err = capsys.readouterr().err
        assert "different workloads" in err and "--allow-different" in err
        assert all(line in err for line in named), err
        assert main([*compare, "--allow-different"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("WARNING: A and B are runs of different workloads")
        assert all(line in out.split("\n\n")[0] for line in named) and "figure" in out
