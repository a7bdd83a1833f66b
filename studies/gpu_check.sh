#!/usr/bin/env bash
# The GPU check (issue 16 and the GPU goals of later issues) on one H200:
#
#     bash studies/gpu_check.sh OUTDIR
#
# run from the repository root on a machine with one CUDA GPU, under its own python3
# (the H200 machine's: torch 2.11, Triton 3.6, transformers 5.17, no internet; every
# other package kvgate's engine imports is already there). A package it lacks travels
# as wheels in .whl/ (see /work/.library/device/README.md), installed here first.
#
# 1. the CUDA-marked tests (tests/backend_gpu/test_cuda.py: greedy output of the tiny
#    models on CUDA equal to transformers' on the CPU under the near-tie rule, with CUDA
#    graphs and without, the memory profile, W8A8 against bfloat16, an embedding
#    model's vectors on CUDA against the CPU's; and
#    test_triton_attention.py's, test_triton_lora.py's and test_triton_int4.py's kernels
#    at model sizes against the torch path; test_quantized_checkpoints.py's GPTQ, AWQ and
#    compressed-tensors models through the INT4 kernel, which need the compressed-tensors
#    package: a wheel in .whl/; test_gpt_oss.py's MXFP4 gpt-oss against transformers and
#    test_triton_mxfp4.py's kernel path at gpt-oss-120b's expert sizes;
#    test_triton_mla.py's MLA kernel at DeepSeek-V3's widths; test_qwen2_5_vl.py's
#    Qwen2.5-VL with images, decodes at the M-RoPE offset in CUDA graphs;
#    test_gemma3_vision.py's Gemma 3 with images, an image's rows seeing ahead in the
#    Triton prefill kernel), at most TEST_S
#    seconds: OUTDIR/pytest.log,
#    OUTDIR/pytest.xml;
# 2. python -m studies.gpu_check (throughput of a random-weight Llama-3-8B-shaped model:
#    kvgate bfloat16 against transformers' continuous batching, bfloat16 against FP8,
#    batch-1 decode against the memory bandwidth), at most BENCH_S seconds:
#    OUTDIR/gpu_check.json, OUTDIR/gpu_check.log;
# 3. the measurements of later issues, each a `step` below with its own time limit and
#    OUTDIR/NAME.log (and the files its study writes), in the order they appear.
# STEPS="tests bench NAME ..." runs only those (default: all), so that the whole check can
# be split over two commands where one command's time is limited (600 s on the device
# tool): STEPS="tests bench" first, then the step names.
# OUTDIR/env.txt says what the machine had. Exit status: the tests' (0 when all passed).
set -u -o pipefail
out=${1:?usage: bash studies/gpu_check.sh OUTDIR}
mkdir -p "$out"
python=${PYTHON:-python3}
test_s=${TEST_S:-120}
bench_s=${BENCH_S:-200}
copy_s=${COPY_S:-30}
steps=" ${STEPS:-all} "
wanted() { [[ $steps == " all " || $steps == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvgate-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/kvgate-site${PYTHONPATH:+:$PYTHONPATH}
fi

{
    date -u
    nvidia-smi || true
    "$python" -c 'import sys, torch, triton, transformers
print(sys.version)
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())
print("triton", triton.__version__, "transformers", transformers.__version__)'
} >"$out/env.txt" 2>&1

# the tests first: they say whether the numbers after them mean anything
tests=0
if wanted tests; then
    timeout -k 10 "$test_s" "$python" -m pytest -q -rfEs -m cuda -p no:cacheprovider \
        --junitxml="$out/pytest.xml" \
        tests/backend_gpu/test_cuda.py tests/backend_gpu/test_triton_attention.py \
        tests/backend_gpu/test_triton_lora.py tests/backend_gpu/test_triton_int4.py \
        tests/backend_gpu/test_quantized_checkpoints.py tests/backend_gpu/test_gpt_oss.py \
        tests/backend_gpu/test_triton_mxfp4.py tests/backend_gpu/test_triton_mla.py \
        tests/backend_gpu/test_qwen2_5_vl.py tests/backend_gpu/test_gemma3_vision.py 2>&1 |
        tee "$out/pytest.log"
    tests=${PIPESTATUS[0]}
    echo "gpu_check.sh: tests exited $tests" | tee -a "$out/pytest.log"
fi

if wanted bench; then
    timeout -k 10 $((bench_s + 30)) "$python" -m studies.gpu_check --out "$out" \
        --budget-s "$bench_s" 2>&1 | tee "$out/gpu_check.log"
    echo "gpu_check.sh: bench exited ${PIPESTATUS[0]}" | tee -a "$out/gpu_check.log"
fi

# step NAME SECONDS CMD...: one measurement after the tests, cut at SECONDS, its output
# in OUTDIR/NAME.log; a step that fails or runs out is reported and the next one runs
step() {
    local name=$1 seconds=$2
    shift 2
    wanted "$name" || return 0
    timeout -k 10 "$seconds" "$@" 2>&1 | tee "$out/$name.log"
    echo "gpu_check.sh: $name exited ${PIPESTATUS[0]}" | tee -a "$out/$name.log"
}

# issue 33: KV blocks device to host and back through the host tier's HostRows, blocks/s
# and GB/s, against one plain pinned non_blocking torch copy of the same bytes
step kv_tiers_copy "$copy_s" "$python" -m studies.kv_tiers_copy --out "$out"
# issue 34: a mixed-adapter batch through the LoRA kernels on one projection, against a
# per-adapter torch loop and the base matmul alone
step lora_kernels "${LORA_S:-45}" "$python" -m studies.lora_kernels --out "$out"
# issue 34: 8 adapters of rank 16 mixed over 16 streams against the base model alone (goal
# 0.8x) and against merged models swapped on demand, a random Llama of hidden 2048 and 8
# layers in bfloat16, and a cold adapter's added TTFT
step lora_throughput "${LORA_MIX_S:-100}" "$python" -m studies.lora_throughput --out "$out" \
    --device cuda --dtype bfloat16 --hidden 2048 --layers 8 --heads 16 --vocab 32000 \
    --per-stream 2 --kv-cache-mib 4096 --arms base mixed naive cold
# issue 35: decode of a random Llama-shaped 1.1B model, GPTQ INT4 (the Triton kernel)
# against bfloat16 at batch 1 and 64 (goal 2x at batch 1), batch 1's share of the bandwidth
step int4_throughput "${INT4_S:-60}" "$python" -m studies.int4_throughput --device cuda --out "$out"
# issue 38: kvgate plan's KV blocks against the engine's allocation (random Llamas of 52M
# and 140M parameters in bfloat16 at 0.5 of the GPU), goal within 5%
step plan_check "${PLAN_S:-30}" "$python" -m studies.plan_check --out "$out"
# issue 37: one MoE layer of Mixtral 8x7B's shape (8 experts of 14336, top 2, bfloat16):
# the experts' Triton grouped GEMM against transformers' loop over experts, 16 to 2048 tokens
step moe_kernels "${MOE_S:-45}" "$python" -m studies.moe_throughput --device cuda --out "$out"
# issue 47: one layer of gpt-oss-120b's experts (128 of 2880, top 4): the experts' kernel
# path over MXFP4 weights against the same over bfloat16 weights, 16 to 2048 tokens
step gpt_oss_mxfp4 "${MXFP4_S:-60}" "$python" -m studies.gpt_oss_throughput --device cuda --out "$out"
# issue 47: DeepSeek-V3's decode attention on one layer (a latent row of 512 + 64 a token,
# 16 and 128 heads, batches 1-64 of 4k-32k tokens): the MLA kernel against the dense
# kernel over every head's keys and values, and the latent bytes it reads a second
step deepseek_mla "${MLA_S:-60}" "$python" -m studies.deepseek_mla --device cuda --out "$out"
# issue 49: EAGLE-3's verifying step (a random head's 3 chained passes and the target over
# 4 positions a sequence) against a plain decode step, a random 1.1B Llama, batch 1-64
step eagle3_verify "${EAGLE3_S:-120}" "$python" -m studies.eagle3_gpu --out "$out"
# issue 52: a 5-turn chat sending one 896x896 image (1,024 image tokens) each turn on a
# random Qwen2.5-VL-shaped model (tower 16 blocks of 1280, decoder 8 layers of 1024,
# bfloat16): TTFT with the encoder cache and prefix caching against neither (goal 3x at
# turn 5), and each cache alone
step vision_cache "${VISION_S:-240}" "$python" -m studies.vision_cache --device cuda \
    --dtype bfloat16 --hidden 1024 --layers 8 --vision-hidden 1280 --vision-depth 16 \
    --image-size 896 --kv-cache-mib 2048 --out "$out"
# issue 50: batch lines beside interactive requests on the gpu engine with 2 sequence slots
# (a random Llama of hidden 2048 and 8 layers in bfloat16, 16 tokens a request): the
# interactive median alone against beside a running batch (goal 1.5x) and beside the same
# lines as ordinary requests, the batch's tokens/s idle against ordinary requests' (goal 0.9x).
# It runs a whole `kvgate serve`: the gateway's packages the image lacks (pydantic,
# sqlalchemy, alembic, aiosqlite, asyncpg, orjson, redis, llguidance, opentelemetry-api and
# their needs, as a probe of the imports on the CPU found) must be wheels in .whl/
step batch_yield "${BATCH_S:-120}" "$python" -m studies.batch_yield --backend gpu \
    --device cuda --dtype bfloat16 --hidden 2048 --layers 8 --heads 16 --vocab 32000 \
    --kv-cache-mib 4096 --lines 48 --interactive 20 --out "$out/batch_yield.json"
# new steps above this line
exit "$tests"
