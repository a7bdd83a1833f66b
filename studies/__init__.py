"""kvgate's studies: one-off measurements behind docs/PERF.md (hostile input and upstreams,
scale-out, PostgreSQL gateways, llama.cpp comparisons, engine steps, ...). Each runs as
`python -m studies.<name>` from the repository root and writes to docs/perf/. They live
outside the wheel: the product's benchmark tool is `bench` (`kvgate bench`), which they may
import, never the reverse; what they share is in studies/harness.py."""
