"""kvgate's benchmarks: `bench serve` and `bench sweep` drive any OpenAI-compatible server
over HTTP; `bench ladder` measures the in-process engine (`backend_gpu`) step by step."""
