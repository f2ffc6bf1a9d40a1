#!/usr/bin/env bash
# The GPU suite in one command: gpu-marked tests, Table 5.3 (per-op SEQ vs fused), the Table 5.2
# workloads for every system, and (on request) the serving sweep.
#
#   bash bench/gpu_suite.sh OUTDIR [--dry-run] [--steps STEP,...]
#     (steps: tests ops profile graphs triton table serve generate llama)
#   PYTHONPATH=/tmp/site:$PWD bash bench/gpu_suite.sh $OUT          # on the GPU machine
#
# Every step runs under its own `timeout` carved from one budget (SUITE_BUDGET_S), so one hang
# cannot eat the call; each appends a summary line (and SKIPPED/ERROR lines with reasons) to
# OUTDIR/suite.log. Files in OUTDIR (at most 8): suite.log, tests.log, ops.json, profile.json,
# table.json, plots.tar.gz, bench.log, graph_policy.json, triton.json, serve.json, generate.json,
# llama.json (graphs, triton, serve, generate and llama are off by default: --steps graphs,serve
# is one call, --steps generate another, --steps llama another, --steps tests,ops,triton another).
# Intermediate files live in a temp dir.
#
# --dry-run (automatic when torch sees no CUDA): the same steps on the CPU with the tiny
# presets, T = 1 2, 2 repeats; every GPU-only part is marked SKIPPED with its reason.
#
# Environment (defaults in brackets; GPU run / dry run):
#   SUITE_BUDGET_S   whole suite, seconds [510 / 170]
#   STEPS            steps to run [tests,ops,profile,table]; --steps overrides
#   GRAPHS_ARGS GRAPHS_TIMEOUT_S   the graphs step (bench/graph_policy.py: CUDA graph policies
#                    and attention backends over serving-like batches; GPU only): its arguments
#                    [--batches 60 --rounds 2] and cap [150]
#   PROFILE_MODELS PROFILE_TENANTS   bench/profile_forward.py's models and tenant counts
#                    [bert-base / -] [4 32 / -] (where the fused forward's time goes; GPU only)
#   TRITON_MODELS TRITON_TENANTS TRITON_TIMEOUT_S   the triton step (bench/triton_forward.py:
#                    seq and itif with cuBLAS and with itif's Triton GEMM, ITIF_TRITON_GEMM=1)
#                    [bert-base / bert-tiny] [4 32 / 2] [240 / 120]; ITIF_TRITON_GEMM=1 in the
#                    suite's own environment runs every step with the Triton GEMM instead
#   MODELS           [bert-base albert-large vit-base / bert-tiny albert-tiny vit-tiny]
#   TENANTS          [1 2 4 8 32 / 1 2]
#   SYSTEMS          [seq multi_stream hf hf_compiled mps itif itif_nographs]
#   STRATEGIES       itif planner strategies [packed]
#   REPEATS          timed runs per system [5 / 2]
#   BACK_TO_BACK     1: the table also times each system's repeats in a row after the
#                    interleaved ones (latency_ms_alone, speedup_vs_<baseline>_alone) [1]; 0: not
#   DTYPE            [float16 / float32]
#   COMPILE_MODE     torch.compile mode of hf_compiled [max-autotune]
#   COMPILE_BOUND    1: bound max-autotune's compile time (GEMM autotuning only) [1]; 0: full
#   COMPILED_MODELS COMPILED_TENANTS   where hf_compiled runs [every model / every T]; the rest of
#                    its rows are skipped as not selected (a compile costs a minute or more)
#   MPS_MAX_TENANTS  mps only up to this tenant count (a process per tenant) [4]
#   TESTS_TIMEOUT_S OPS_TIMEOUT_S SERVE_TIMEOUT_S   per-step caps [150 60 480 / 90 60 120]
#   SERVE_MODEL SERVE_TENANTS SERVE_MIX SERVE_DURATION_S
#                    [bert-base 16 uniform:2-100+zipf:1.2 5 / bert-tiny 4 (same mix) 1]
#   SERVE_ARGS       more `itif bench` options for the serve step, e.g. "--serve-strategies packed
#                    --serve-max-batch-tokens 32768" [none]
#   GEN_ARGS         bench/bench_generate.py's workload (the thesis' Decoding row: seq, hf, itif)
#                    [marian-decoding, 8 tenants x 4 requests, beam 4, 128 source tokens, 32 new /
#                    marian-tiny, 2 x 2, beam 2, 16, 4]; GENERATE_TIMEOUT_S [300 / 120]
#   LLAMA_ARGS       `itif bench --suites decoder` options of the llama step (issue 66: LoRA and
#                    full tenants of a Llama, itif vs HF + PEFT; vLLM skipped off the CPU)
#                    [--dec-shape llama3-8b-l2 --dtype bfloat16 --repeats 3 / --quick --repeats 1]
#                    (--device is the suite's); LLAMA_TIMEOUT_S [420 / 150]
#   PYTHON           [python3]
set -u -o pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
OUT=""
DRY=0
STEPS_ARG=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --steps) STEPS_ARG="${2:-}"; shift ;;
    --steps=*) STEPS_ARG="${1#--steps=}" ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_suite.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) if [ -z "$OUT" ]; then OUT="$1"; else echo "gpu_suite.sh: extra argument $1" >&2; exit 2; fi ;;
  esac
  shift
done
[ -n "$OUT" ] || { usage >&2; exit 2; }
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/suite.log"
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 2
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$(date +%s.%N)

elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
say() { echo "[$(printf '%6s' "$(elapsed)")s] $*" | tee -a "$LOG"; }
left() { awk -v a="$T0" -v b="$(date +%s.%N)" -v B="$BUDGET" 'BEGIN { printf "%d", B - (b - a) }'; }
# step timeout: min(cap, what is left minus what later steps need at least)
step_timeout() {
  local cap=$1 reserve=$2 l
  l=$(( $(left) - reserve ))
  [ "$l" -lt "$cap" ] && echo "$l" || echo "$cap"
}

PYINFO=$("$PY" -c 'import sys, torch; print(torch.cuda.is_available(), sys.version.split()[0], "torch", torch.__version__)' 2>/dev/null | tail -1)
CUDA=${PYINFO%% *}
[ "$CUDA" = "True" ] || CUDA="False"
REASON=""
if [ "$DRY" = 1 ]; then
  REASON="--dry-run"
elif [ "$CUDA" != "True" ]; then
  DRY=1
  REASON="no CUDA: torch.cuda.is_available() is False"
fi
: > "$LOG"
if [ "$DRY" = 1 ]; then
  BUDGET=${SUITE_BUDGET_S:-170}
  MODELS=${MODELS:-"bert-tiny albert-tiny vit-tiny"}
  TENANTS=${TENANTS:-"1 2"}
  REPEATS=${REPEATS:-2}
  DTYPE=${DTYPE:-float32}
  DEVICE=cpu
  QUICK="--quick"
  TESTS_CAP=${TESTS_TIMEOUT_S:-50}; OPS_CAP=${OPS_TIMEOUT_S:-30}; SERVE_CAP=${SERVE_TIMEOUT_S:-120}
  SERVE_MODEL=${SERVE_MODEL:-bert-tiny}; SERVE_TENANTS=${SERVE_TENANTS:-4}
  SERVE_DURATION_S=${SERVE_DURATION_S:-1}
  OPS_ARGS="--cpu"
  TABLE_ARGS="--one-part --compiled-min 20"
  RES_OPS_MIN=10; RES_TABLE_MIN=80; RES_SERVE_MIN=40
  GEN_ARGS=${GEN_ARGS:-"--preset marian-tiny --tenants 2 --requests 2 --beams 2 --src-len 16 --new-tokens 4 --repeats 1"}
  GEN_CAP=${GENERATE_TIMEOUT_S:-120}
  LLAMA_ARGS=${LLAMA_ARGS:-"--quick --repeats 1"}
  LLAMA_CAP=${LLAMA_TIMEOUT_S:-150}
  TRITON_MODELS=${TRITON_MODELS:-bert-tiny}; TRITON_TENANTS=${TRITON_TENANTS:-2}
  TRITON_CAP=${TRITON_TIMEOUT_S:-120}; TRITON_ARGS="--allow-cpu --repeats 2"
else
  BUDGET=${SUITE_BUDGET_S:-510}
  MODELS=${MODELS:-"bert-base albert-large vit-base"}
  TENANTS=${TENANTS:-"1 2 4 8 32"}
  REPEATS=${REPEATS:-5}
  DTYPE=${DTYPE:-float16}
  DEVICE=cuda
  QUICK=""
  TESTS_CAP=${TESTS_TIMEOUT_S:-150}; OPS_CAP=${OPS_TIMEOUT_S:-60}; SERVE_CAP=${SERVE_TIMEOUT_S:-480}
  SERVE_MODEL=${SERVE_MODEL:-bert-base}; SERVE_TENANTS=${SERVE_TENANTS:-16}
  SERVE_DURATION_S=${SERVE_DURATION_S:-5}
  OPS_ARGS=""
  TABLE_ARGS=""
  RES_OPS_MIN=30; RES_TABLE_MIN=240; RES_SERVE_MIN=200
  GEN_ARGS=${GEN_ARGS:-"--preset marian-decoding --tenants 8 --requests 4 --beams 4 --src-len 128 --new-tokens 32 --repeats 3"}
  GEN_CAP=${GENERATE_TIMEOUT_S:-300}
  LLAMA_ARGS=${LLAMA_ARGS:-"--dec-shape llama3-8b-l2 --dtype bfloat16 --repeats 3"}
  LLAMA_CAP=${LLAMA_TIMEOUT_S:-420}
  TRITON_MODELS=${TRITON_MODELS:-bert-base}; TRITON_TENANTS=${TRITON_TENANTS:-"4 32"}
  TRITON_CAP=${TRITON_TIMEOUT_S:-240}; TRITON_ARGS=""
fi
SYSTEMS=${SYSTEMS:-"seq multi_stream hf hf_compiled mps itif itif_nographs"}
STRATEGIES=${STRATEGIES:-packed}
BACK_TO_BACK=${BACK_TO_BACK:-1}
COMPILE_MODE=${COMPILE_MODE:-max-autotune}
COMPILE_BOUND=${COMPILE_BOUND:-1}
COMPILED_MODELS=${COMPILED_MODELS:-}
COMPILED_TENANTS=${COMPILED_TENANTS:-}
MPS_MAX_TENANTS=${MPS_MAX_TENANTS:-4}
SERVE_MIX=${SERVE_MIX:-"uniform:2-100+zipf:1.2"}
STEPS=${STEPS_ARG:-${STEPS:-tests,ops,profile,table}}
PROFILE_MODELS=${PROFILE_MODELS:-bert-base}
PROFILE_TENANTS=${PROFILE_TENANTS:-"4 32"}
PROFILE_CAP=${PROFILE_TIMEOUT_S:-90}
GRAPHS_CAP=${GRAPHS_TIMEOUT_S:-150}
GRAPHS_ARGS=${GRAPHS_ARGS:-"--batches 60 --rounds 2"}
has_step() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

say "suite start: $( [ "$DRY" = 1 ] && echo "DRY RUN on the CPU ($REASON)" || echo "GPU run" ); steps $STEPS; budget ${BUDGET}s; cuda=$CUDA; python ${PYINFO#* }"
if [ "$DRY" = 1 ]; then
  say "  SKIPPED GPU run: $REASON; tiny presets ($MODELS), T = $TENANTS, $REPEATS repeats, $DTYPE on the CPU"
fi
if [ "$CUDA" = "True" ]; then
  say "  gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
fi

# run_step NAME TIMEOUT OUTFILE CMD...: runs CMD under timeout (stdout and stderr appended to
# OUTFILE, or to the terminal for "-"), logs the outcome; sets RC
run_step() {
  local name=$1 to=$2 outfile=$3; shift 3
  if [ "$to" -lt 5 ]; then
    say "step $name: SKIPPED: time budget spent (${to}s left for it)"
    RC=124; FAILS="$FAILS $name"; return
  fi
  local t1; t1=$(date +%s.%N)
  if [ "$outfile" = "-" ]; then
    timeout -k 10 "$to" "$@"
  else
    timeout -k 10 "$to" "$@" >> "$outfile" 2>&1
  fi
  RC=$?
  local dt; dt=$(awk -v a="$t1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  case $RC in
    0) STATUS="ok" ;;
    124|137) STATUS="TIMEOUT after ${to}s"; FAILS="$FAILS $name" ;;
    *) STATUS="FAILED (rc $RC)"; FAILS="$FAILS $name" ;;
  esac
  say "step $name: $STATUS in ${dt}s (timeout ${to}s)"
}

FAILS=""
# reserves (seconds) later steps need at least
RES_OPS=0; RES_TABLE=0
has_step ops && RES_OPS=$RES_OPS_MIN
has_step table && RES_TABLE=$RES_TABLE_MIN

# ---- (a) gpu-marked tests -----------------------------------------------------------------------
if has_step tests; then
  TO=$(step_timeout "$TESTS_CAP" $((RES_OPS + RES_TABLE)))
  : > "$OUT/tests.log"
  # a module that cannot import (a package the machine lacks) costs that module, not the step's
  # other tests; it still fails the step, and the summary names it
  run_step tests "$TO" "$OUT/tests.log" "$PY" -m pytest -q -m gpu -p no:cacheprovider -rfE \
    --continue-on-collection-errors --durations=10 tests
  "$PY" -m itif.bench.suite summary-tests "$OUT/tests.log" --cuda "$CUDA" | sed 's/^/  /' | tee -a "$LOG"
else
  say "step tests: not selected (--steps $STEPS)"
fi

# ---- (b) Table 5.3: per-op times, SEQ vs fused ----------------------------------------------------
if has_step ops; then
  TO=$(step_timeout "$OPS_CAP" "$RES_TABLE")
  run_step ops "$TO" "$OUT/bench.log" "$PY" bench/bench_ops.py $OPS_ARGS --out "$OUT/ops.json"
  "$PY" -m itif.bench.suite summary-ops "$OUT/ops.json" | sed 's/^/  /' | tee -a "$LOG"
else
  say "step ops: not selected (--steps $STEPS)"
fi

# ---- (b2) where the fused forward's time goes: host, graph replay, kernels by kind ----------------
if has_step profile; then
  if [ "$DRY" = 1 ]; then
    say "step profile: SKIPPED: it profiles the CUDA path ($REASON)"
  else
    TO=$(step_timeout "$PROFILE_CAP" "$RES_TABLE")
    run_step profile "$TO" "$OUT/bench.log" "$PY" bench/profile_forward.py \
      --models $PROFILE_MODELS --tenants $PROFILE_TENANTS --dtype "$DTYPE" --out "$OUT/profile.json"
  fi
else
  say "step profile: not selected (--steps $STEPS)"
fi

# ---- (b3) when to capture CUDA graphs, which attention: bench/graph_policy.py (off by default) ----
if has_step graphs; then
  if [ "$DRY" = 1 ]; then
    say "step graphs: SKIPPED: it times CUDA graphs and torch's attention backends ($REASON)"
  else
    RES_AFTER=$RES_TABLE
    has_step serve && RES_AFTER=$((RES_AFTER + RES_SERVE_MIN))
    TO=$(step_timeout "$GRAPHS_CAP" "$RES_AFTER")
    run_step graphs "$TO" "$OUT/bench.log" "$PY" bench/graph_policy.py $GRAPHS_ARGS \
      --dtype "$DTYPE" --out "$OUT/graph_policy.json"
    "$PY" -c 'import json, sys
d = json.load(open(sys.argv[1]))
for name, s in d["summary"].items():
    print(name, {k: v for k, v in s.items() if k != "best"})' "$OUT/graph_policy.json" 2>&1 \
      | sed 's/^/  /' | tee -a "$LOG"
  fi
else
  say "step graphs: not selected (--steps $STEPS)"
fi

# ---- (b4) itif's Triton GEMM against cuBLAS in the forward: bench/triton_forward.py (off by default)
if has_step triton; then
  TO=$(step_timeout "$TRITON_CAP" "$RES_TABLE")
  # without a GPU the kernel runs under Triton's interpreter, which Triton reads at import
  INTERP=""; [ "$DRY" = 1 ] && INTERP="TRITON_INTERPRET=1"
  run_step triton "$TO" "$OUT/bench.log" env $INTERP "$PY" bench/triton_forward.py \
    --models $TRITON_MODELS --tenants $TRITON_TENANTS $TRITON_ARGS --out "$OUT/triton.json"
  "$PY" -c 'import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print({k: v for k, v in r.items() if k not in ("dtype",)})' "$OUT/triton.json" 2>&1 \
    | sed 's/^/  /' | tee -a "$LOG"
else
  say "step triton: not selected (--steps $STEPS; on the GPU: --steps tests,ops,triton)"
fi

# ---- (c) Table 5.2 workloads, every system ---------------------------------------------------------
if has_step table; then
  RES_SERVE=0
  has_step serve && RES_SERVE=$RES_SERVE_MIN
  TO=$(step_timeout 100000 "$RES_SERVE")
  BOUND=""; [ "$COMPILE_BOUND" = 1 ] && BOUND="--compile-bound"
  STRAT=""; [ -n "$STRATEGIES" ] && STRAT="--strategies $STRATEGIES"
  B2B=""; [ "$BACK_TO_BACK" = 1 ] && B2B="--back-to-back"
  CSEL=""
  [ -n "$COMPILED_MODELS" ] && CSEL="--compiled-models $COMPILED_MODELS"
  [ -n "$COMPILED_TENANTS" ] && CSEL="$CSEL --compiled-tenants $COMPILED_TENANTS"
  # the table step shares its own budget among its parts (timeout minus a margin to finish)
  run_step table "$TO" - "$PY" -m itif.bench.suite table --out-dir "$OUT" --log "$LOG" \
    --budget $((TO - 10)) --models $MODELS --tenants $TENANTS --systems $SYSTEMS $STRAT \
    --repeats "$REPEATS" --device "$DEVICE" --dtype "$DTYPE" --compile-mode "$COMPILE_MODE" \
    $BOUND $CSEL --mps-max-tenants "$MPS_MAX_TENANTS" $QUICK $B2B $TABLE_ARGS
else
  say "step table: not selected (--steps $STEPS)"
fi

# ---- (d) serving sweep through the daemon (off by default: its own call on the GPU) --------------
if has_step serve; then
  TO=$(step_timeout "$SERVE_CAP" 0)
  run_step serve "$TO" "$OUT/bench.log" "$PY" -m itif bench --suites serve \
    --serve-model "$SERVE_MODEL" --serve-tenants "$SERVE_TENANTS" --mixes "$SERVE_MIX" \
    --serve-duration "$SERVE_DURATION_S" --serve-p99-at 0.7 --device "$DEVICE" --dtype "$DTYPE" \
    --serve-budget $((TO > 60 ? TO - 30 : TO / 2)) --no-plots --out "$OUT/serve.json" $QUICK \
    ${SERVE_ARGS:-}
  "$PY" -m itif.bench.suite summary-serve "$OUT/serve.json" | sed 's/^/  /' | tee -a "$LOG"
else
  say "step serve: not selected (--steps $STEPS; on the GPU it runs in its own call: --steps serve)"
fi

# ---- (e) generation: the Decoding row, seq / hf / itif (off by default: its own call) -------------
if has_step generate; then
  TO=$(step_timeout "$GEN_CAP" 0)
  run_step generate "$TO" "$OUT/bench.log" "$PY" bench/bench_generate.py $GEN_ARGS \
    --device "$DEVICE" --out "$OUT/generate.json"
  "$PY" -m itif.bench.suite summary-generate "$OUT/generate.json" | sed 's/^/  /' | tee -a "$LOG"
else
  say "step generate: not selected (--steps $STEPS; on the GPU it runs in its own call: --steps generate)"
fi

# ---- (f) the Llama decoder suite: LoRA and full tenants, itif vs HF + PEFT (its own call) ---------
if has_step llama; then
  TO=$(step_timeout "$LLAMA_CAP" 0)
  run_step llama "$TO" "$OUT/bench.log" "$PY" -m itif bench --suites decoder --device "$DEVICE" \
    --no-plots --out "$OUT/llama.json" $LLAMA_ARGS
  "$PY" -c 'import json, sys
keys = ("tokens_per_s", "ms_per_output_token", "equal_fraction", "first_divergence", "vs_hf")
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["system"], r.get("status"), {k: r[k] for k in keys if k in r}, r.get("reason", ""))' \
    "$OUT/llama.json" 2>&1 | sed 's/^/  /' | tee -a "$LOG"
else
  say "step llama: not selected (--steps $STEPS; on the GPU it runs in its own call: --steps llama)"
fi

say "suite done in $(elapsed)s; $( [ -z "$FAILS" ] && echo "every step ok" || echo "steps not ok:$FAILS"); files: $(cd "$OUT" && ls | tr '\n' ' ')"
[ -z "$FAILS" ]
