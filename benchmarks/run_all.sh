#!/usr/bin/env bash
# The index of the benchmarks: every one, by group, with the command that writes each file under
# benchmarks/results/<group>/ (each script's --out defaults to that file). Each script runs from
# the repository root as `python -m benchmarks.<group>.<name>`; `--help` says what it measures.
#
#   bash benchmarks/run_all.sh                  # every group: hours on 2 cores
#   bash benchmarks/run_all.sh model serving    # some groups
#
# peers/ and serving/client_cost.py need the bench extra: pip install -e '.[bench]'.
# benchmarks/common.py holds what the scripts share (a server for a `with` block, /proc CPU time,
# percentiles, the JSON result).
set -euo pipefail
cd "$(dirname "$0")/.."
r=benchmarks/results

model() {  # in-process: the model, its kernels, its step, sampling, snapshots
  python -m benchmarks.model.decode --threads 1 --gemm inductor own --step-batches 1 4 64   # model/decode.json
  python -m benchmarks.model.table               # model/table.md, model/table.json
  python -m benchmarks.model.aoti_step           # model/aoti_step.json
  python -m benchmarks.model.own_gemm --inductor # model/own_gemm.json
  python -m benchmarks.model.kernel_kinds        # model/kernel_kinds.json
  python -m benchmarks.model.lowp_matmul --bpb   # model/lowp_matmul.json
  python -m benchmarks.model.sampler --reps 7    # model/sampler.txt
  python -m benchmarks.model.grammar_libs        # model/grammar_libs.json (pip install llguidance xgrammar outlines-core)
  python -m benchmarks.model.constrained         # model/constrained.json
  python -m benchmarks.model.snapshots           # model/snapshots.json (in-process and over each store)
  # billion-parameter checkpoints at published shapes (random weights, ~25 GB under ~/.cache/linstream)
  python -m benchmarks.model.big_checkpoints     # writes them once (Mamba 1.4B/2.8B, Mamba-2 1.3B, RWKV-7 1.5B)
  python -m benchmarks.model.big_serving --weights float32 bfloat16 int8 --prefill 256
                                                 # model/big_checkpoints.json (all four)
  # On a machine with a CUDA device (results under $OUT, default /tmp/gpu_check, not here):
  #   bash benchmarks/model/gpu_check.sh         # the CUDA tests, then benchmarks.model.gpu_decode
}

serving() {  # over HTTP against a real `linstream serve`
  python -m benchmarks.serving.request_path --models linear mamba --levels 1 8 64 256 --duration 8 --reps 4
                                                 # serving/request_path.json
  python -m benchmarks.serving.thread_cpu --model linear                               # serving/thread_cpu.json
  python -m benchmarks.serving.client_cost --model linear --clients 64 --rounds 2      # serving/client_cost.json
  python -m benchmarks.serving.choices --model linear                                  # serving/choices.json
  python -m benchmarks.serving.many_sessions --sessions 10000                          # serving/many_sessions.json
  python -m benchmarks.serving.history_append                                          # serving/history_append.json
  python -m benchmarks.serving.prefix_chat                                             # serving/prefix_chat.json, .png
  python -m benchmarks.serving.responses_chain --reps 25                               # serving/responses_chain.json
  python -m benchmarks.serving.client_state --replicas 2 --reps 15                    # serving/client_state.json
  python -m benchmarks.serving.cluster           # serving/cluster.json (serve --replicas: HAProxy, Redis)
  if [ -n "${BEFORE:-}" ]; then  # a checkout to compare with: git archive REV | tar -x -C "$BEFORE"
    python -m benchmarks.serving.request_cpu --before "$BEFORE" --rounds 4 --n 800     # serving/request_cpu.json
    python -m benchmarks.serving.aggregate_ab --before "$BEFORE" --rounds 3 --clients 64   # prints only
  else
    echo "skipping request_cpu and aggregate_ab: set BEFORE to a checkout to compare with" >&2
  fi
  cli_clients
}

cli_clients() (  # linstream's own client commands against one server with every shipped model
  port=8100
  mkdir -p $r/serving
  LINSTREAM_MAX_KV_SESSIONS=2 linstream serve -m linear -m performer -m retnet -m gla -m rwkv -m mamba -m hybrid \
      -m softmax --port $port --threads 1 --store memory --log-level warning &
  srv=$!
  trap 'kill $srv' EXIT
  until curl -sf http://127.0.0.1:$port/healthz >/dev/null; do sleep 0.5; done
  python -m benchmarks.serving.latency --url http://127.0.0.1:$port --threads 1 --models linear,mamba,softmax \
      --out $r/serving/latency                   # serving/latency.json, .png
  python -m benchmarks.serving.latency --url http://127.0.0.1:$port --threads 1 --contexts 128,4096,32768 --tokens 32 \
      --out $r/serving/latency_mixers            # serving/latency_mixers.json, .png
  linstream loadtest --url http://127.0.0.1:$port --model linear --concurrency 1,8,64,256 --duration 20 \
      --out $r/serving/loadtest                  # serving/loadtest.json, .png
)

peers() {  # beside llama.cpp (llama-cpp-python; its own llama-server and llama-bench) and transformers
  python -m benchmarks.peers.shipped             # peers/shipped.json, .png
  python -m benchmarks.peers.mamba130m           # peers/mamba130m.json
  python -m benchmarks.peers.llama_server        # peers/llama_server.json (builds llama.cpp once: peers/llama_build.py)
  python -m benchmarks.peers.llama_big --models mamba-1.4b mamba2-1.3b rwkv7-1.5b mamba-2.8b --prompt 256
                                                 # peers/llama_big.json (after big_serving)
  python -m benchmarks.peers.llama_big_served --models mamba-1.4b rwkv7-1.5b   # peers/llama_big_served.json
  # benchmarks/peers/lm_eval_task/: lm-eval's `local_text` task against a running server
  # (--include_path benchmarks/peers/lm_eval_task --tasks local_text); no file here.
}

robustness() {  # faults, fuzzing, hostile requests, long load
  python -m benchmarks.robustness.soak --concurrency 256 --duration 630                 # robustness/soak.json
  python -m benchmarks.robustness.faults --concurrency 256 --duration 30 --signal term  # robustness/faults_term.json
  python -m benchmarks.robustness.faults --concurrency 256 --duration 30 --signal kill  # robustness/faults_kill.json
  python -m benchmarks.robustness.fuzz_api --examples 100                               # robustness/fuzz_api.json
  python -m benchmarks.robustness.hostile_stall --phase-s 5                             # robustness/hostile_stall.json
  python -m benchmarks.robustness.hostile_stall --phase-s 5 --only quiet,n16_sampled_4096,prompts128_best_of2,n16_echo_22801_prompt,n16_hangup_after_3s,streams54,quiet_after \
      --out benchmarks/results/robustness/hostile_stall_heavy.json                      # single heavy requests, 54 streams of one key
}

# results/flames/: py-spy flame graphs of a server under load, recorded by hand; the commands are
# in results/flames/README.md.

groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(model serving peers robustness)
for g in "${groups[@]}"; do
  case $g in
    model|serving|peers|robustness) echo "== $g" >&2; $g ;;
    *) echo "unknown group: $g (model, serving, peers, robustness)" >&2; exit 2 ;;
  esac
done
