"""The measuring half of `kvgate tune`: a candidate served, benchmarked against the
goals (stopped early once they are lost), recorded in the history, within the budget.
tune.py decides which candidates to run."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.client import RequestOutput
from bench.compare import serve_figures
from bench.history import make_record, save_record
from bench.metrics import request_tpot
from bench.options import build_requests, request_shape, serve_config, workload_info
from bench.serve import serve_benchmark
from bench.server_memory import MemorySampler
from bench.tune_server import Candidate, CandidateServer, config_toml

WARMUP_REQUESTS = 2  # per candidate, unmeasured: the first steps compile and fill caches


@dataclass(frozen=True)
class Goals:
    ttft_p99_s: float
    tpot_p99_s: float

    def met_by(self, figures: dict) -> bool:
        return (
            figures.get("failed", 1) == 0
            and figures["p99_ttft_ms"] <= 1000 * self.ttft_p99_s
            and figures["p99_tpot_ms"] <= 1000 * self.tpot_p99_s
        )

    def misses(self, figures: dict) -> list[str]:
        """Each goal `figures` miss, and by how much."""
        out = [f"{figures['failed']:.0f} requests failed"] if figures.get("failed") else []
        for metric, goal in (("TTFT", self.ttft_p99_s), ("TPOT", self.tpot_p99_s)):
            value = figures[f"p99_{metric.lower()}_ms"] / 1000
            if value > goal:
                out.append(
                    f"p99 {metric} {value:.3f} s, over its goal of {goal:g} s by "
                    f"{value - goal:.3f} s ({value / goal:.1f}x)"
                )
        return out

    def shortfall(self, figures: dict) -> float:
        """How far `figures` are from the goals: the larger of p99 over goal, TTFT's and
        TPOT's (at most 1 where both are met)."""
        return max(
            figures["p99_ttft_ms"] / 1000 / self.ttft_p99_s,
            figures["p99_tpot_ms"] / 1000 / self.tpot_p99_s,
        )


@dataclass
class Measured:
    candidate: Candidate
    stage: str
    rounds: list[dict] = field(default_factory=list)  # each round's figures
    error: str = ""  # it did not start, or a goal was lost early ("stopped: ...")
    note: str = ""  # measured on part of the workload: its share of the budget was spent
    seconds: float = 0.0  # start and benchmark, every round

    def median(self, name: str) -> float:
        values = [r.get(name, math.nan) for r in self.rounds]
        return statistics.median(values) if values else math.nan

    def figures(self) -> dict[str, float]:
        """The medians the goals are judged by."""
        return {n: self.median(n) for n in ("p99_ttft_ms", "p99_tpot_ms", "failed")}

    def meets(self, goals: Goals) -> bool:
        if self.error or not self.rounds:
            return False
        return goals.met_by(self.figures())


class GoalWatch:
    """Stops a run once a goal is lost: when more requests exceed a goal than the p99
    of `total` requests can hide, the p99 exceeds it whatever the rest do. A failed
    request loses the run too. Prints progress at each quarter."""

    def __init__(self, goals: Goals, total: int, label: str) -> None:
        self.goals, self.total, self.label = goals, total, label
        # p99 by linear interpolation lies at or above the value at floor(0.99 (n - 1))
        self.allowed = total - math.floor(0.99 * (total - 1)) - 1
        self.over_ttft = self.over_tpot = self.done = 0
        self.reason = ""

    def __call__(self, out: RequestOutput) -> bool:
        self.done += 1
        if 4 * self.done // self.total != 4 * (self.done - 1) // self.total:
            print(f"  {self.label}: {self.done}/{self.total} requests", flush=True)
        tpot = request_tpot(out) if out.success else None
        self.over_ttft += out.success and out.ttft > self.goals.ttft_p99_s
        self.over_tpot += tpot is not None and tpot > self.goals.tpot_p99_s
        if not out.success:
            self.reason = f"a request failed: {out.error[:80]}"
        elif self.over_ttft > self.allowed:
            self.reason = f"{self.over_ttft} requests over the TTFT goal: its p99 is lost"
        elif self.over_tpot > self.allowed:
            self.reason = f"{self.over_tpot} requests over the TPOT goal: its p99 is lost"
        return bool(self.reason)


class Tuner:
    """Runs candidates within the budget; keeps every measurement."""

    def __init__(
        self, args: argparse.Namespace, goals: Goals, budget_s: float, out: Path, command: list
    ) -> None:
        self.args, self.goals, self.budget_s, self.out = args, goals, budget_s, out
        self.command = command
        self.started = time.monotonic()
        # the goals are judged on p99 TTFT and TPOT, whatever the report shows besides
        args.percentile_metrics = "ttft,tpot,itl,e2el"
        if "99" not in args.metric_percentiles.split(","):
            args.metric_percentiles += ",99"
        self.requests = build_requests(args)
        self.workload = workload_info(args) | {"num_prompts": len(self.requests)}
        self.base = {
            "device": args.device,
            "dtype": args.dtype,
            "max_model_len": args.max_model_len,
            "gpu_memory_utilization": args.gpu_memory_utilization,
        }
        self.measured: list[Measured] = []
        # how long one candidate may send requests: search() shares the budget out
        self.share_s = budget_s
        (out / "candidates").mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def can_afford(self) -> bool:
        """Whether another candidate fits in what is left: one as long as the average
        so far (the first always runs)."""
        if not self.measured:
            return True
        average = statistics.mean(m.seconds for m in self.measured)
        return self.left() >= average

    def best(self) -> Measured | None:
        meeting = [m for m in self.measured if m.meets(self.goals)]
        return max(meeting, key=lambda m: m.median("output_throughput"), default=None)

    def closest(self) -> Measured | None:
        """When none meets the goals, the one nearest them: no failed requests first,
        then the smallest shortfall (p99 over goal), then the most tokens/s. None when
        no candidate was measured at all."""
        measured = [m for m in self.measured if not any(map(math.isnan, m.figures().values()))]

        def distance(m: Measured) -> tuple:
            figures = m.figures()
            return (
                figures["failed"] > 0,
                self.goals.shortfall(figures),
                -m.median("output_throughput"),
            )

        return min(measured, key=distance, default=None)

    def run_stage(self, stage: str, candidates: list[Candidate]) -> None:
        seen = {m.candidate for m in self.measured}
        todo = [c for c in dict.fromkeys(candidates) if c not in seen]
        for i, candidate in enumerate(todo):
            if not self.can_afford():
                print(f"[{stage}] budget spent: {len(todo) - i} candidates left out", flush=True)
                return
            print(f"[{stage} {i + 1}/{len(todo)}] {candidate.name} ({self.left():.0f}s left)")
            measured = Measured(candidate, stage)
            self.measure(measured)
            self.measured.append(measured)
            self.progress(measured)

    def repeat_close_calls(self) -> None:
        """When the two best meeting the goals are within the noise, run both again."""
        meeting = sorted(
            (m for m in self.measured if m.meets(self.goals)),
            key=lambda m: m.median("output_throughput"),
            reverse=True,
        )
        if len(meeting) < 2:
            return
        first, second = meeting[:2]
        a, b = first.median("output_throughput"), second.median("output_throughput")
        if a - b > self.args.noise * a:
            return
        for m in (first, second):
            if not self.can_afford():
                print("[repeat] budget spent before the close call was settled")
                return
            print(f"[repeat] {m.candidate.name}: within {self.args.noise:.0%} of the other")
            self.measure(m)
            self.progress(m)

    def measure(self, m: Measured) -> None:
        """One more round of `m`: serve it, warm it up, benchmark it, record it."""
        started = time.monotonic()
        toml = self.out / "candidates" / f"{m.candidate.name}.toml"
        toml.write_text(config_toml(self.args.model, self.base, m.candidate))
        try:
            workdir, timeout = self.out / "candidates", self.args.start_timeout
            with CandidateServer(toml, workdir, timeout, self.starting) as srv:
                self.bench(m, srv)
        except (RuntimeError, OSError) as e:
            m.error = f"did not start: {e}"[:300]
        m.seconds += time.monotonic() - started

    @staticmethod
    def starting(line: str) -> None:
        print(f"  starting: {line}", flush=True)

    def bench(self, m: Measured, server: CandidateServer) -> None:
        args = argparse.Namespace(**vars(self.args))
        # candidates share one database: tenants of their own for each run
        run = f"tune-{len(self.measured)}-{len(m.rounds)}"
        keys = [server.api_key(f"{run}-{i}") for i in range(args.num_tenants)]
        args.url, args.api_key, args.api_key_file = server.url, ",".join(keys), None
        args.goodput, args.no_progress, args.model = None, True, None
        cfg = serve_config(args, args.max_concurrency)
        # the share bounds the warm-up and the run: requests start until it is spent,
        # and those in flight get half as long again before they are cut
        began, share = time.monotonic(), self.share_s
        serve_benchmark(replace(cfg, abort_after_s=share), self.requests[:WARMUP_REQUESTS])
        left = share - (time.monotonic() - began)
        if left <= 0:
            m.error = f"stopped: its share of the budget ({share:.0f} s) went on warming up"
            return
        watch = GoalWatch(self.goals, len(self.requests), m.candidate.name)
        cfg = replace(cfg, abort_when=watch, send_for_s=left, abort_after_s=left + share / 2)
        with MemorySampler(server.proc.pid) as memory:
            result, _ = serve_benchmark(cfg, self.requests, self.workload)
        figures = serve_figures(result) | memory.figures()
        self.judge(m, watch.reason, result)
        m.rounds.append(figures)
        config = {
            "candidate": m.candidate.name,
            "stage": m.stage,
            "stopped": m.error.removeprefix("stopped: "),
        }
        config |= m.candidate.engine_options() | self.base | self.workload
        config |= request_shape(self.args) | {"model": self.args.model}
        config["max_concurrency"] = self.args.max_concurrency
        config["goals"] = {"ttft_p99_s": self.goals.ttft_p99_s, "tpot_p99_s": self.goals.tpot_p99_s}
        record = make_record("tune", self.command, config, [figures], memory.peak())
        save_record(record, self.args.results_dir)

    def judge(self, m: Measured, lost: str, result: dict) -> None:
        """A run's verdict beyond its figures: stopped (a goal lost, or requests cut at
        the end of its share: not to be chosen), or measured on part of the workload."""
        finished, total = len(result["ttfts"]), len(self.requests)
        share = f"its share of the budget ({self.share_s:.0f} s)"
        if lost:
            m.error = f"stopped: {lost}"
        elif result["cut_in_flight"]:
            m.error = f"stopped: {share} ran out with {result['cut_in_flight']} requests unfinished"
        elif finished < total:
            m.note = f"measured on {finished} of {total} requests: {share} was spent"

    def progress(self, m: Measured) -> None:
        if m.error:
            print(f"  -> {m.error}", flush=True)
        else:
            if m.note:
                print(f"  -> {m.note}", flush=True)
            verdict = "meets the goals" if m.meets(self.goals) else "misses the goals"
            print(
                f"  -> {m.median('output_throughput'):.1f} output tok/s, p99 TTFT "
                f"{m.median('p99_ttft_ms') / 1000:.3f} s, p99 TPOT "
                f"{m.median('p99_tpot_ms') / 1000:.3f} s: {verdict}",
                flush=True,
            )
        best = self.best()
        if best is not None:
            print(
                f"  best so far: {best.candidate.name}, {best.median('output_throughput'):.1f} tok/s"
            )
