"""studies/hostile.py: its judgement of answers, its lost-rows count, and its smallest run
against real `kvgate serve --backend fake` processes."""

import json

from studies.hostile import main
from studies.hostile_http import Reply, classify
from studies.hostile_load import billed_not_delivered, lost_rows

CASES = [
    "no_key",
    "invalid_json",
    "metrics_without_key",
    "content_length_and_chunked",
    "half_sent_headers",
]


def test_lost_rows_finds_the_response_without_a_row():
    completed = ["chatcmpl-a", "chatcmpl-b", "chatcmpl-c"]
    recorded = {"chatcmpl-a", "chatcmpl-c", "chatcmpl-x"}  # b's row is missing, x undelivered
    assert lost_rows(completed, recorded) == ["chatcmpl-b"]
    assert billed_not_delivered(completed, recorded) == ["chatcmpl-x"]
    assert lost_rows(completed, recorded | {"chatcmpl-b"}) == []
    assert billed_not_delivered(completed, set(completed)) == []


def test_classify_tells_openai_errors_from_the_rest():
    error = json.dumps({"error": {"message": "no", "type": "x", "param": None, "code": None}})
    assert classify(Reply(400, error.encode(), "application/json")) == "openai"
    assert classify(Reply(400, b'{"error": "no"}', "application/json")) == "non-json"
    assert classify(Reply(500, b"500 Internal Server Error", "text/plain")) == "non-json"
    assert classify(Reply(200, b'{"id": "x"}', "application/json")) == "json"
    sse = "text/event-stream"
    assert classify(Reply(200, b'data: {"id": "x"}\n\ndata: [DONE]\n\n', sse)) == "sse"
    assert classify(Reply(200, b'data: {"id": "x"}\n\n', sse)) == "non-json"  # cut off
    assert classify(Reply(None, shape="held")) == "held"


def test_smallest_run_of_every_part(tmp_path, capsys):
    out, png = tmp_path / "hostile.json", tmp_path / "stall.png"
    rc = main(
        [
            "--cases",
            ",".join(CASES),
            "--slow-timeout",
            "1",
            "--bomb-mib",
            "4",
            "--quiet-s",
            "0.3",
            "--attack-s",
            "0.5",
            "--attack-concurrency",
            "1",
            "--fanout-prompts",
            "2",
            "--fanout-n",
            "2",
            "--clients",
            "4",
            "--load-s",
            "1",
            "--out",
            str(out),
            "--plot",
            str(png),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["database"] == "sqlite"

    bad = result["bad"]
    assert sorted(c["name"] for c in bad["cases"]) == sorted(CASES)
    assert bad["tried"] == 5
    assert bad["kinds"] == {"auth": 2, "body/JSON types": 1, "headers/parser": 2}
    by_name = {c["name"]: c for c in bad["cases"]}
    assert by_name["no_key"]["status"] == 401 and by_name["no_key"]["shape"] == "openai"
    assert by_name["no_key"]["expected"] is True
    assert bad["5xx"] == sum(1 for c in bad["cases"] if (c["status"] or 0) >= 500)
    assert bad["unexpected"] == sum(1 for c in bad["cases"] if not c["expected"])

    stall = result["stall"]
    assert [w["name"] for w in stall["windows"]] == ["quiet", "fan-out", "compression"]
    assert all(w["samples"] > 0 and w["max_ms"] >= w["p99_ms"] for w in stall["windows"])
    assert png.stat().st_size > 0

    kill9 = result["kill9"]
    assert kill9["completed"] > 0 and kill9["completed_streams"] > 0
    assert kill9["restarted"] is True
    assert kill9["lost_rows"] == len(kill9["lost_ids"]) == 0
    # every response received whole has its row; the rest were billed, not delivered
    assert kill9["rows"] == kill9["completed"] + kill9["billed_not_delivered"]

    printed = capsys.readouterr().out
    assert "Bad inputs: 5 tried" in printed and "usage rows lost (goal 0): 0" in printed
