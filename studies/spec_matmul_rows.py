"""What scoring more rows costs on this CPU: a verifying step multiplies k + 1 rows by
every weight where a plain step multiplies one, and on a CPU a float32 product's time
depends on how the BLAS treats those few rows, not only on the weight it reads.

    python -m studies.spec_matmul_rows --rows 1 2 3 4 5 8 --save-result OUT.json

For a model's shapes (SmolLM2 135M's by default: 30 layers of q/k/v 960 x 576, o 576 x
576, gate/up 3072 x 576, down 576 x 1536, and its 49,152 x 576 LM head) it times, in
this thread's CPU time (one torch thread; a loaded machine's waits left out), the
median over --repeats of: every layer's four products for `rows` rows in each of the
engine's candidate forms (backend_gpu/layers/cpu_rows.py: `linear` (x @ W.T), (W @ x.T).T,
oneDNN's) and in the form the engine measures fastest for each shape and rows ("chosen"),
in bfloat16 too with --bf16; and the LM head the same ways. A buffer larger than the
cache is written between timings, so the weights come from memory as in a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from backend_gpu.layers import cpu_rows
from bench.options import DefaultsHelpFormatter

FORMS = {name: lambda x, w, form=form: form(x, w, None) for name, form in cpu_rows.FORMS.items()}
FORMS["chosen"] = lambda x, w: cpu_rows.linear(x, w)


def cpu_ms(fn, flush: torch.Tensor) -> float:
    flush.mul_(1.0)  # the weights out of the cache
    start = time.thread_time()
    fn()
    return 1000 * (time.thread_time() - start)


def layer_weights(args, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    h, i, qkv = args.hidden, args.intermediate, args.qkv
    shapes = [(qkv, h), (h, h), (2 * i, h), (h, i)]
    return [[torch.randn(o, n, dtype=dtype) for o, n in shapes] for _ in range(args.layers)]


def measure(args) -> dict:
    """{case: {rows: median CPU ms}} for each form, over the layers and the LM head."""
    flush = torch.empty(args.flush_mb << 18)
    cases = {}
    for dtype in [torch.float32] + ([torch.bfloat16] if args.bf16 else []):
        layers = layer_weights(args, dtype)
        head = torch.randn(args.vocab, args.hidden, dtype=dtype)
        for w in [*layers[0], head]:  # "chosen"'s timings at first use left out
            for rows in args.rows:
                cpu_rows.chosen_form(w, rows)
        for form, fn in FORMS.items():
            tag = f"{form} {str(dtype).removeprefix('torch.')}"

            def run_layers(x: dict[int, torch.Tensor], fn=fn, layers=layers) -> None:
                for weights in layers:
                    for w in weights:
                        fn(x[w.shape[1]], w)

            times: dict[str, dict[int, list[float]]] = {"layers": {}, "LM head": {}}
            for _ in range(args.repeats):
                for rows in args.rows:
                    x = {
                        n: torch.randn(rows, n, dtype=dtype)
                        for n in {args.hidden, args.intermediate}
                    }
                    lm = times["LM head"].setdefault(rows, [])
                    times["layers"].setdefault(rows, []).append(
                        cpu_ms(lambda x=x: run_layers(x), flush)
                    )
                    lm.append(cpu_ms(lambda x=x, fn=fn, head=head: fn(x[args.hidden], head), flush))
            for part, by_rows in times.items():
                cases[f"{part}: {tag}"] = {
                    r: round(statistics.median(v), 2) for r, v in by_rows.items()
                }
    return cases


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--qkv", type=int, default=960, help="the packed q/k/v output width")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--flush-mb", type=int, default=128, help="written between timings")
    p.add_argument("--bf16", action="store_true", help="bfloat16 weights too")
    p.add_argument("--save-result", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cases = measure(args)
    print("| CPU ms | " + " | ".join(f"{r} rows" for r in args.rows) + " |")
    print("|---|" + "---:|" * len(args.rows))
    for case, by_rows in cases.items():
        one = by_rows[args.rows[0]]
        cells = [f"{by_rows[r]:.1f} ({by_rows[r] / one:.2f}x)" for r in args.rows]
        print(f"| {case} | " + " | ".join(cells) + " |")
    chosen = {f"{d} {o}x{i}, {r} rows": f for (d, o, i, r), f in cpu_rows.choices().items()}
    print("chosen:", chosen)
    result = {"args": vars(args), "torch": torch.__version__, "cpu_ms": cases, "chosen": chosen}
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
