#!/usr/bin/env bash
# The NPU check, the Ascend counterpart of scripts/gpu-check.sh: run on an Ascend host with CANN
# installed and its environment sourced (`source /usr/local/Ascend/ascend-toolkit/set_env.sh`,
# or cann/set_env.sh on 8.5+), it runs in one go and writes one report, DIR/report.md and DIR/logs/
# (DIR: --out, else $OUT, else target/npu-check-out):
#
#   scripts/npu-check.sh [--bin NPU_SERVING] [--tests DIR | --no-conformance] [--tool GPU_KIT_TOOL]
#                        [--donor DONOR.gguf] [--out DIR] [--budget S] [--dry-run]
#
#   1. the environment: npu-smi info, the CANN version (version.cfg and the binary's own log
#      line), the ASCEND_* variables, the CANN libraries the binary opened;
#   2. the conformance suite on the Ascend backend: the agent's conformance tests
#      (agent/tests/conformance.rs, the Ascend candidate alone: every op, a model step and the
#      greedy checks against the CPU reference; a deliberately wrong op must fail; the staged
#      collectives over two devices) and the default model on the Ascend backend
#      (agent/tests/ascend_model.rs) — test binaries built with `cargo test --no-run` when cargo
#      is here, else taken from --tests DIR (files `conformance` and `ascend_model`);
#   3. fidelity: greedy and teacher-forced agreement of `--device ascend` with the CPU backend
#      and with llama.cpp's recorded tokens (agent/tests/data/family_*.jsonl) on random-weight
#      models of every family made here (`npu-serving synth-model`: llama, llama3, qwen2, qwen3,
#      qwen3moe, gemma3, deepseek2; gemma3 runs in bf16 (its hidden states outgrow f16; the backend chooses
#      bf16 for it at load), judged with a bf16 margin; qwen3moe runs MoeGatingTopKSoftmaxV2 and MoeFinalizeRoutingV2, never run on an
#      NPU before; deepseek2 runs MoeGatingTopK and its latent attention through
#      FusedInferAttentionScoreV2 over a latent pool, never run on an NPU before), and on the
#      default model when it is in the model cache;
#   4. speed: `npu-serving bench-model --device ascend` on the 1B-shaped (and 8B-shaped, if time
#      allows) random Q4_0 models, as a table; llama.cpp beside it only when a CANN build of it is
#      given (LLAMA_CPP_CANN_BIN: a folder with llama-bench and llama-batched-bench).
# The checks stay within --budget seconds (default 900; building the binaries comes before and is
# not counted) and report what had no time as SKIPPED, never as passed. Exit status 1 when a step
# FAILED, else 0.
#
# The binaries: --bin (default: `cargo build --release --features ascend --bin npu-serving` when
# cargo is here, else target/release/npu-serving, which must have been built with that feature);
# --tool, the kit's backend-neutral helper (default: `cargo build --release -p npu-backend-cuda
# --example gpu_kit_tool`, no GPU needed); --donor, a GGUF with the default model's tokenizer
# (default: made from the default model by the helper, which fetches it when absent).
#
# --dry-run: on a machine without an NPU, over the strict CANN emulation (ASCEND_HOME_PATH from
# scripts/ascend-emulator.sh, unless it already names the emulation): the conformance and
# fidelity steps run on the emulation; the hardware-only steps report SKIPPED with the reason
# (bench-model runs on the tiny llama model as a smoke run of the table's code, labelled not a
# measurement). Without --dry-run the check refuses to run over the emulation.
#
# Knobs (for small machines and for tests of this script): NPU_CHECK_FAMILIES (default all seven),
# NPU_CHECK_PROMPTS (reference lines, default "0 2"), NPU_CHECK_TOKENS (greedy tokens, default
# 32), NPU_CHECK_SHAPES (default "1b 8b"; "1b" in a dry run; empty: none), NPU_CHECK_WORK (work
# folder, default target/npu-check-work).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

bin=""
tests=""
conformance=1
tool=""
donor=""
out=${OUT:-target/npu-check-out}
dry=0
budget=900
usage="usage: scripts/npu-check.sh [--bin NPU_SERVING] [--tests DIR | --no-conformance] [--tool GPU_KIT_TOOL] [--donor DONOR.gguf] [--out DIR] [--budget S] [--dry-run]"
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=$2; shift ;;
    --tests) tests=$2; shift ;;
    --no-conformance) conformance=0 ;;
    --tool) tool=$2; shift ;;
    --donor) donor=$2; shift ;;
    --out) out=$2; shift ;;
    --budget) budget=$2; shift ;;
    --dry-run) dry=1 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
case "$budget" in ''|*[!0-9]*) echo "--budget takes seconds" >&2; exit 2 ;; esac

work=${NPU_CHECK_WORK:-$root/target/npu-check-work}
rm -rf "$work/report" "$work/summary" "$work/logs" "$work/runs" "$work/skipped.count"
mkdir -p "$out/logs" "$work/report" "$work/summary" "$work/models" "$work/logs" "$work/runs"
out=$(cd "$out" && pwd)
logs=$work/logs
t0=$(date +%s)
started=$t0
left() { echo $((budget - ($(date +%s) - started))); }
# A timeout of at most $1 seconds, and never past the budget (at least 1).
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo $((l > 1 ? l : 1)) || echo "$1"; }
say() { echo "npu-check [$(($(date +%s) - t0))s]: $*" >&2; }
die() { echo "npu-check: $*" >&2; exit 2; }

# Each step writes its part of the report ($work/report/NN-name.md) and its summary line
# ($work/summary/NN-name.txt); FAILED and SKIPPED are counted for the summary and the exit status.
part_file() { echo "$work/report/$1.md"; }
summary() { echo "$2" >"$work/summary/$1.txt"; }
# skipped() is called inside $(...) too, so it counts in a file.
failed=0
skipped() { echo >>"$work/skipped.count"; echo "SKIPPED: $*"; }

have_cargo=0
command -v cargo >/dev/null 2>&1 && have_cargo=1

# ---- the CANN install ----------------------------------------------------------------------
# cann_home becomes ASCEND_HOME_PATH after the builds below: npu-ffi's build script reruns when
# that variable changes, so the builds see the caller's environment, as the caller's own builds do.
cann_home=${ASCEND_HOME_PATH:-}
if [ $dry = 1 ]; then
  if [ -z "$cann_home" ] || [ ! -f "$cann_home/EMULATION.txt" ]; then
    [ $have_cargo = 1 ] || die "the dry run builds the CANN emulation with cargo (or set ASCEND_HOME_PATH to it)"
    say "building the CANN emulation (scripts/ascend-emulator.sh)"
    cann_home=$(scripts/ascend-emulator.sh 2>"$logs/emulator-build.log") ||
      die "scripts/ascend-emulator.sh failed ($logs/emulator-build.log)"
  fi
  mode="DRY RUN over the strict CANN emulation (not an NPU)"
else
  [ -n "$cann_home" ] || cann_home=${ASCEND_TOOLKIT_HOME:-}
  if [ -n "$cann_home" ] && [ -f "$cann_home/EMULATION.txt" ]; then
    die "ASCEND_HOME_PATH ($cann_home) is the CANN emulation, not CANN: run with --dry-run"
  fi
  [ -n "$cann_home" ] ||
    die "no CANN environment (ASCEND_HOME_PATH, ASCEND_TOOLKIT_HOME): source /usr/local/Ascend/ascend-toolkit/set_env.sh (CANN <= 8.3) or /usr/local/Ascend/cann/set_env.sh (8.5+) first; --dry-run runs over the emulation"
  mode="NPU"
fi
export RUST_LOG=${RUST_LOG:-info}

# ---- the binaries --------------------------------------------------------------------------
builds=""
build() { # name, log, command...
  local name=$1 log=$2 t=$(date +%s)
  shift 2
  say "building $name"
  if "$@" >"$log" 2>&1; then
    builds+="- $name: built in $(($(date +%s) - t)) s (\`${*}\`)"$'\n'
  else
    builds+="- $name: FAILED to build (logs/$(basename "$log"))"$'\n'
    return 1
  fi
}
if [ -z "$bin" ]; then
  if [ $have_cargo = 1 ]; then
    build npu-serving "$logs/build-npu-serving.log" cargo build --release --features ascend --bin npu-serving ||
      die "cargo build --release --features ascend failed ($logs/build-npu-serving.log)"
  fi
  bin=target/release/npu-serving
fi
[ -x "$bin" ] || die "no npu-serving binary at $bin (build it with: cargo build --release --features ascend)"
bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
# A binary built without the `ascend` feature does not name the aclnn operators it loads.
grep -qa aclnnRmsNormGetWorkspaceSize "$bin" ||
  die "$bin was built without the ascend feature (cargo build --release --features ascend)"

if [ -z "$tool" ]; then
  if [ $have_cargo = 1 ]; then
    build gpu_kit_tool "$logs/build-gpu-kit-tool.log" cargo build --release -p npu-backend-cuda --example gpu_kit_tool
  fi
  tool=target/release/examples/gpu_kit_tool
fi
[ -x "$tool" ] || die "no gpu_kit_tool at $tool (cargo build --release -p npu-backend-cuda --example gpu_kit_tool, or --tool PATH)"
tool=$(cd "$(dirname "$tool")" && pwd)/$(basename "$tool")

# The test binaries of the conformance step: --tests DIR, else built here.
conf_bin=""
model_bin=""
conf_why=""
if [ $conformance = 0 ]; then
  conf_why="left out (--no-conformance)"
elif [ -n "$tests" ]; then
  [ -x "$tests/conformance" ] && conf_bin=$tests/conformance
  [ -x "$tests/ascend_model" ] && model_bin=$tests/ascend_model
  [ -n "$conf_bin$model_bin" ] || conf_why="no test binaries named conformance or ascend_model in $tests"
elif [ $have_cargo = 1 ]; then
  if build "the conformance test binaries" "$logs/build-tests.log" \
       cargo test --release -p npu-agent --features ascend --test conformance --test ascend_model \
       --no-run --message-format=json; then
    exe() { grep '"reason":"compiler-artifact"' "$logs/build-tests.log" | grep "\"name\":\"$1\"" |
              grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -1; }
    conf_bin=$(exe conformance)
    model_bin=$(exe ascend_model)
  else
    conf_why="the test binaries did not build (logs/build-tests.log)"
  fi
else
  conf_why="no cargo here to build the test binaries, and no --tests DIR"
fi

export ASCEND_HOME_PATH=$cann_home

read -r -a families <<<"${NPU_CHECK_FAMILIES-llama llama3 qwen2 qwen3 qwen3moe gemma3 deepseek2}"
read -r -a prompts <<<"${NPU_CHECK_PROMPTS-0 2}"
ntok=${NPU_CHECK_TOKENS:-32}
if [ $dry = 1 ]; then
  read -r -a shapes <<<"${NPU_CHECK_SHAPES-1b}"
else
  read -r -a shapes <<<"${NPU_CHECK_SHAPES-1b 8b}"
fi

# The default model, when it is in the model cache (the store's rule: $NPU_SERVING_CACHE, else
# $XDG_CACHE_HOME/npu-serving, else ~/.cache/npu-serving; models/), the file of llama.cpp's
# references (NPU_SERVING_MODEL may name another model: it is not used here).
cache=${NPU_SERVING_CACHE:-${XDG_CACHE_HOME:+$XDG_CACHE_HOME/npu-serving}}
cache=${cache:-$HOME/.cache/npu-serving}
default_model=$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$default_model" ] || default_model=""

# How many NPUs this process sees (empty when unknown): the collectives' test needs two.
npus=""
if [ $dry = 0 ]; then
  if [ -n "${ASCEND_RT_VISIBLE_DEVICES:-}" ]; then
    npus=$(echo "$ASCEND_RT_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
  elif command -v npu-smi >/dev/null 2>&1; then
    npus=$(timeout 30 npu-smi info -l 2>/dev/null | awk -F: '/Total Count/ {gsub(/ /, "", $2); print $2; exit}')
  fi
  case "$npus" in *[!0-9]*) npus="" ;; esac
fi

# The tokenizer donor of the family models.
donor_why=""
if [ -z "$donor" ]; then
  donor=$work/models/donor-tokenizer.gguf
  if [ ! -s "$donor" ]; then
    "$tool" donor --from "${default_model:-default}" --out "$donor" >"$logs/donor.log" 2>&1 ||
      { donor_why="no tokenizer donor: the default model is not here and could not be fetched (logs/donor.log); pass --donor"; donor=""; }
  fi
fi
[ -z "$donor" ] || [ -s "$donor" ] || { donor_why="--donor $donor does not exist"; donor=""; }

started=$(date +%s)  # the budget starts with the checks

# ---- the environment ---------------------------------------------------------------------
cann_versions() {
  local d f seen=" "
  for d in "${ASCEND_HOME_PATH:-}" "${ASCEND_TOOLKIT_HOME:-}" /usr/local/Ascend/ascend-toolkit/latest /usr/local/Ascend/cann; do
    [ -n "$d" ] && [ -d "$d" ] || continue
    d=$(cd "$d" && pwd -P)
    case "$seen" in *" $d "*) continue ;; esac
    seen+="$d "
    for f in version.cfg runtime/version.info compiler/version.info; do
      [ -f "$d/$f" ] && echo "$d/$f: $(grep -iE 'version' "$d/$f" | head -3 | tr '\n' ' ')"
    done
  done
  [ -f /usr/local/Ascend/driver/version.info ] &&
    echo "driver: $(grep -iE 'version' /usr/local/Ascend/driver/version.info | head -2 | tr '\n' ' ')"
  return 0
}
env_part() {
  {
    echo "## Environment ($mode)"
    echo
    echo '```'
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ); host: $(uname -srm); CPUs: $(nproc); memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
    if [ $dry = 1 ]; then
      echo "npu-smi: dry run (no NPU)"
    elif command -v npu-smi >/dev/null 2>&1; then
      echo "npu-smi info:"
      timeout 30 npu-smi info 2>&1 | head -60
    else
      echo "npu-smi: not found"
    fi
    [ $dry = 1 ] || echo "NPUs this process sees: ${npus:-unknown} (ASCEND_RT_VISIBLE_DEVICES, else npu-smi info -l)"
    echo "CANN version files:"
    cann_versions | sed 's/^/  /'
    echo "ASCEND_* variables:"
    env | grep -E '^ASCEND_' | sort | sed 's/^/  /'
    echo "LD_LIBRARY_PATH: ${LD_LIBRARY_PATH:-(unset)}"
    echo "npu-serving: $bin ($(sha256sum "$bin" | cut -c1-12)…, built $(date -u -r "$bin" +%Y-%m-%dT%H:%MZ))"
    echo "gpu_kit_tool: $tool"
    if [ -d .git ] || git rev-parse --git-dir >/dev/null 2>&1; then
      echo "source: commit $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (with uncommitted changes)')"
    fi
    echo '```'
    echo
    if [ -n "$builds" ]; then
      echo "Built here before the checks (not counted in the budget of $budget s):"
      echo
      printf '%s' "$builds"
      echo
    fi
  } >"$(part_file 00-env)"
}
# What the binary loaded (its log line at start: the CANN version and the libraries it opened).
env_loaded() {
  local l
  l=$(grep -hoE 'CANN .* loaded from .*' "$logs"/fidelity-ascend.log "$logs"/bench-*.log 2>/dev/null | sort -u | head -3)
  if [ -n "$l" ]; then
    printf 'Loaded by npu-serving (its log line at start: the CANN version it read and the libraries it opened):\n\n```\n%s\n```\n\n' "$l" >"$(part_file 01-loaded)"
    summary 01-loaded "environment: $(echo "$l" | head -1 | sed -E 's/ loaded from.*//')$([ $dry = 1 ] && echo ' (the emulation'"'"'s version)')"
  else
    printf 'Loaded by npu-serving: no `CANN … loaded from` line in the Ascend runs'"'"' logs (none ran?).\n\n' >"$(part_file 01-loaded)"
    summary 01-loaded "environment: no Ascend run logged the CANN version"
  fi
}

# ---- conformance -------------------------------------------------------------------------------
# What a test shows when it prints no table of checks of its own.
declare -A CONF_NOTE=(
  [a_deliberately_wrong_op_on_a_device_backend_fails_the_suite]="the backend with a wrong matmul, rope, attention or greedy pick fails the op checks on that op"
  [gemma3_is_refused_on_f16_activations]="Gemma 3 270M refused at load when f16 activations are imposed, naming f16's range"
  [gemma3_runs_in_bf16_and_matches_llama_cpp]="Gemma 3 270M (the real file) in bf16: teacher-forced top-1 and greedy tokens picked on the device against llama.cpp's"
)
conformance_part() {
  local f spec bin_name exe limit names name log rc t note checks rows="" c_failed=0 c_passed=0 c_skipped=0
  f=$(part_file 10-conformance)
  if [ -n "$conf_why" ]; then
    printf '## Conformance suite on the Ascend backend\n\n%s\n\n' "$(skipped "$conf_why")" >"$f"
    summary 10-conformance "conformance: SKIPPED ($conf_why)"
    return
  fi
  # binary name | binary | timeout per test | the tests to run (none: all of them)
  local specs=(
    "conformance|$conf_bin|300|every_backend_present_conforms a_deliberately_wrong_op_on_a_device_backend_fails_the_suite collectives_conform_over_the_ascend_backend"
    "ascend_model|$model_bin|300|"
  )
  for spec in "${specs[@]}"; do
    IFS='|' read -r bin_name exe limit names <<<"$spec"
    if [ -z "$exe" ]; then
      rows+="| $bin_name | $(skipped "no $bin_name test binary") |"$'\n'; c_skipped=$((c_skipped + 1)); continue
    fi
    [ -n "$names" ] || names=$("$exe" --list 2>/dev/null | sed -n 's/: test$//p' | tr '\n' ' ')
    # One process per test: its exit status is its result, whatever it prints (--nocapture).
    for name in $names; do
      if [ "$(left)" -lt 60 ]; then
        rows+="| $bin_name: $name | $(skipped "out of time") |"$'\n'; c_skipped=$((c_skipped + 1)); continue
      fi
      if [ "$name" = collectives_conform_over_the_ascend_backend ] && [ -n "$npus" ] && [ "$npus" -lt 2 ]; then
        rows+="| $bin_name: $name | $(skipped "it needs two NPUs; this process sees $npus") |"$'\n'; c_skipped=$((c_skipped + 1)); continue
      fi
      say "conformance: $bin_name $name"
      log=$work/runs/conformance-$bin_name-$name.log
      t=$(date +%s)
      NPU_SERVING_CONFORMANCE_ONLY=ascend timeout "$(cap "$limit")" "$exe" --exact --test-threads=1 --nocapture \
        "$name" >"$log" 2>&1
      rc=$?
      { echo "==== $bin_name $name: exit $rc after $(($(date +%s) - t)) s"; cat "$log"; } >>"$logs/conformance.log"
      # The suite's own checks (its report: "  ok     NAME ..." lines), else what the test printed.
      checks=$(grep -cE '^  ok +' "$log")
      if [ "$checks" -gt 0 ] || grep -qE '^  FAILED +' "$log"; then
        note="$checks checks ok, $(grep -cE '^  FAILED +' "$log") failed ($(grep -m1 -oE 'conformance of .*:$' "$log" | sed -E 's/^conformance of (.*):$/\1/'))"
      elif [ -n "${CONF_NOTE[$name]:-}" ]; then
        note=${CONF_NOTE[$name]}
      else
        note=$(grep -m1 -E "^test $name \.\.\. " "$log" | sed -E "s/^test $name \.\.\. //")
        [ ${#note} -gt 200 ] && note="${note:0:200}…"
      fi
      note=${note//|/\\|}
      if [ $rc = 0 ]; then
        rows+="| $bin_name: $name | ok, $(($(date +%s) - t)) s: $note |"$'\n'; c_passed=$((c_passed + 1))
      else
        rows+="| $bin_name: $name | FAIL: exit $rc$([ $rc = 124 ] && echo ' (timed out)') after $(($(date +%s) - t)) s: $(grep -m1 -E 'panicked' "$log" | cut -c1-200 | sed 's/|/\\|/g') (logs/conformance.log) |"$'\n'
        c_failed=$((c_failed + 1))
      fi
    done
  done
  failed=$((failed + c_failed))
  {
    echo "## Conformance suite on the Ascend backend"
    echo
    echo "The agent's conformance tests with the Ascend backend alone (\`NPU_SERVING_CONFORMANCE_ONLY=ascend\`, one process per test): every op of the device seam, a whole model step and the greedy checks of the default model against the CPU reference with the suite's tolerances; the same ops made wrong on purpose must fail; the staged collectives and a split model step over two devices. Then \`ascend_model\`: the default model run by the agent's model code on the backend, logits against exact arithmetic and the CPU backend, greedy tokens picked on the device with 128- and 16-token blocks, and Gemma 3 270M in bf16 against llama.cpp's tokens (refused when f16 is imposed; these tests fetch the Gemma 3 270M model when it is not cached). Each check's error against its tolerance is in logs/conformance.log."
    echo
    echo "| test | result |"
    echo "|---|---|"
    printf '%s' "$rows"
    echo
    echo "**conformance: $c_passed passed, $c_failed failed, $c_skipped skipped**"
    echo
  } >"$f"
  summary 10-conformance "conformance: $c_passed passed, $c_failed failed, $c_skipped skipped"
}

# ---- fidelity on random-weight models of every family ---------------------------------------
declare -A SEED=([llama]=2 [llama3]=3 [qwen2]=1 [qwen3]=2 [qwen3moe]=1 [gemma3]=3 [deepseek2]=3)
declare -A EXPECTED_REFUSAL=()
margin=0.5  # f16 activations, as gpu-check.sh's f16 rows
# bf16 activations (gemma3: the backend chooses bf16 for it): one bf16 step is 1 at the random
# models' logits of 128-256, so 8 of them.
declare -A MARGIN=([gemma3]=8)
judged=0
f_fails=0
refused=0
f_skipped=0
rows=""
# One prompt of one model: CPU and Ascend, greedy and teacher-forced; appends a row.
fidelity_run() { # label model ref line
  local label=$1 model=$2 ref=$3 p=$4 prompt r cg cs dg ds ids rc line fam=${1%% *}
  if [ "$(left)" -lt 40 ]; then rows+="| $label | $p | $(skipped "out of time") |"$'\n'; f_skipped=$((f_skipped + 1)); return; fi
  prompt=$("$tool" prompt "$ref" "$p") || { rows+="| $label | $p | FAIL: no prompt $p in $(basename "$ref") |"$'\n'; f_fails=$((f_fails + 1)); return; }
  r=$work/runs/${label// /_}-$p
  cg=$r-cpu-gen.json; cs=$r-cpu-score.json; dg=$r-ascend-gen.json; ds=$r-ascend-score.json
  # The device first: a model it refuses needs no CPU run.
  timeout "$(cap 300)" "$bin" generate --device ascend --model "$model" --prompt "$prompt" --max-tokens "$ntok" \
    --ignore-eos --json >"$dg" 2>"$r-ascend.log"
  rc=$?
  if [ $rc = 0 ]; then
    timeout "$(cap 300)" "$bin" generate --device cpu --model "$model" --prompt "$prompt" --max-tokens "$ntok" \
      --ignore-eos --json >"$cg" 2>>"$logs/fidelity-cpu.log" &&
      ids=$("$tool" ids "$cg" 2>/dev/null) &&
      timeout "$(cap 300)" "$bin" score --device cpu --model "$model" --prompt "$prompt" --continuation-ids "$ids" \
        --json >"$cs" 2>>"$logs/fidelity-cpu.log" ||
      { rows+="| $label | $p | FAIL: the CPU backend's run failed (logs/fidelity-cpu.log) |"$'\n'; f_fails=$((f_fails + 1)); return; }
    timeout "$(cap 300)" "$bin" score --device ascend --model "$model" --prompt "$prompt" --continuation-ids "$ids" \
      --json >"$ds" 2>>"$r-ascend.log"
    rc=$?
  fi
  cat "$r-ascend.log" >>"$logs/fidelity-ascend.log"
  if [ $rc != 0 ]; then
    if grep -qiE 'not support|unsupported' "$r-ascend.log"; then
      line="REFUSED: $(grep -m1 -iE 'error' "$r-ascend.log" | cut -c1-240)"
      if [ -n "${EXPECTED_REFUSAL[$fam]:-}" ]; then
        line+=" (expected today: ${EXPECTED_REFUSAL[$fam]})"; refused=$((refused + 1))
      else
        f_fails=$((f_fails + 1))
      fi
    else
      line="FAIL: exit $rc$([ $rc = 124 ] && echo ' (timed out)'): $(grep -m1 -iE 'error|panicked' "$r-ascend.log" | cut -c1-240)"
      f_fails=$((f_fails + 1))
    fi
  else
    line=$("$tool" fidelity --cpu-gen "$cg" --cpu-score "$cs" --dev-gen "$dg" --dev-score "$ds" \
             --margin "${MARGIN[$fam]:-$margin}" --ref "$ref" --line "$p" 2>&1) || f_fails=$((f_fails + 1))
    line=${line//|/\\|}  # |Δ logprob| inside a table cell
    judged=$((judged + 1))
    [ -n "${EXPECTED_REFUSAL[$fam]:-}" ] && line+=" (ran, though a refusal was expected: ${EXPECTED_REFUSAL[$fam]})"
  fi
  rows+="| $label | $p | $line |"$'\n'
}
fidelity_part() {
  local f fam ref model sha want sha_note p dref
  f=$(part_file 20-fidelity)
  say "fidelity on the families' random-weight models"
  for fam in "${families[@]}"; do
    ref=$root/agent/tests/data/family_$fam.jsonl
    [ -f "$ref" ] || { rows+="| $fam | — | FAIL: no reference file $ref |"$'\n'; f_fails=$((f_fails + 1)); continue; }
    if [ -z "$donor" ]; then
      rows+="| $fam | — | $(skipped "$donor_why") |"$'\n'; f_skipped=$((f_skipped + 1)); continue
    fi
    model=$work/models/$fam.gguf
    sha=$("$bin" synth-model --arch "$fam" --seed "${SEED[$fam]}" --type f32 --tokenizer-from "$donor" \
            "$model" 2>>"$logs/synth.log" | cut -d' ' -f1)
    want=$(grep -o '"model_sha256": "[0-9a-f]*"' "$ref" | head -1 | cut -d'"' -f4)
    if [ -z "$sha" ]; then
      rows+="| $fam | — | FAIL: synth-model failed (logs/synth.log) |"$'\n'; f_fails=$((f_fails + 1)); continue
    fi
    [ "$sha" = "$want" ] && sha_note="the file of llama.cpp's references" || sha_note="NOT the file of llama.cpp's references ($want)"
    for p in "${prompts[@]}"; do fidelity_run "$fam" "$model" "$ref" "$p"; done
    rows+="| $fam | | model sha256 ${sha:0:12}…: $sha_note |"$'\n'
  done
  if [ -n "$default_model" ]; then
    # llama.cpp's references of the default model name their first near tie differently.
    dref=$work/runs/greedy_smollm2_q4_1.jsonl
    sed -E 's/"first_step_gap_below_0\.15": *([0-9]+|null)/&, "first_near_tie": \1/' \
      "$root/agent/tests/data/greedy_smollm2_q4_1.jsonl" >"$dref"
    for p in "${prompts[@]}"; do fidelity_run "default model" "$default_model" "$dref" "$p"; done
    rows+="| default model | | $(basename "$default_model") |"$'\n'
  else
    rows+="| default model | | $(skipped "not in the model cache ($cache/models)") |"$'\n'; f_skipped=$((f_skipped + 1))
  fi
  failed=$((failed + f_fails))
  {
    echo "## Fidelity: --device ascend against the CPU backend and llama.cpp"
    echo
    echo "Each family's tiny random-weight model is made here (\`npu-serving synth-model --arch F --seed N --type f32\`, the default model's tokenizer), the same file as llama.cpp's recorded references when the sha256 matches; then the default model (SmolLM2-135M-Instruct Q4_1) when it is in the cache. For prompts ${prompts[*]} of the references: $ntok greedy tokens (\`npu-serving generate --json\`) on the CPU backend and with \`--device ascend\`; the device's tokens must equal the CPU backend's up to the first near tie (a top-1/top-2 logit gap below $margin, the CPU backend's or the device's, teacher-forced along the CPU's tokens with \`npu-serving score\`), its teacher-forced top-1 must equal the CPU backend's wherever that is decided, and its tokens must equal llama.cpp's up to the first near tie. The margin is gpu-check.sh's for f16 activations; gemma3, which the backend computes in bf16 (chosen at load, as its hidden states outgrow f16), takes ${MARGIN[gemma3]} (8 bf16 steps at these models' logits)."
    echo
    echo "| model | prompt | result |"
    echo "|---|---|---|"
    printf '%s' "$rows"
    echo
    echo "**fidelity: $judged judged, $f_fails failed; $refused refused as expected; $f_skipped skipped**"
    echo
  } >"$f"
  summary 20-fidelity "fidelity: $judged judged, $f_fails failed; $refused refused as expected; $f_skipped skipped"
}

# ---- speed ----------------------------------------------------------------------------------
# The device as bench-model's JSON names it.
backend_of() { grep -o '"backend":"[^"]*"' "$1" | head -1 | cut -d'"' -f4; }
shaped_model() { echo "$work/models/random-$1-q4_0.gguf"; }
make_models() {
  local s m
  [ -n "$donor" ] || return 0
  for s in "${shapes[@]}"; do
    m=$(shaped_model "$s")
    [ -s "$m" ] && continue
    say "making the $s-shaped model"
    "$tool" shaped --shape "$s" --donor "$donor" --out "$m.tmp" >>"$logs/models.log" 2>&1 && mv "$m.tmp" "$m" ||
      { echo "making $s failed" >>"$logs/models.log"; rm -f "$m.tmp"; }
  done
}
bench_part() {
  local f s m lb lbb t rows="" notes="" b_failed=0 measured=0
  f=$(part_file 40-bench)
  if [ $dry = 1 ]; then
    # Not a measurement: the table's code path, on the emulation with the tiny llama model.
    m=$work/models/llama.gguf
    if [ -s "$m" ] && [ "$(left)" -gt 30 ]; then
      say "bench-model smoke run on the emulation"
      if timeout "$(cap 300)" "$bin" bench-model --device ascend --model "$m" --json --skip-long --skip-roofline \
           --batches 1,32 --decode-steps 2 >"$work/runs/bench-smoke.json" 2>"$logs/bench-smoke.log"; then
        rows+="$("$tool" bench-row --label "smoke: tiny llama, on the CANN emulation (not a measurement)" --npu "$work/runs/bench-smoke.json")"$'\n'
        notes+="- smoke run's backend: $(backend_of "$work/runs/bench-smoke.json")"$'\n'
      else
        notes+="- FAIL: the smoke run of bench-model on the emulation failed (logs/bench-smoke.log)"$'\n'; b_failed=$((b_failed + 1))
      fi
    else
      notes+="- smoke run: $(skipped "$([ -s "$m" ] && echo 'out of time' || echo 'no tiny llama model (the fidelity step makes it)')")"$'\n'
    fi
    for s in "${shapes[@]}"; do
      m=$(shaped_model "$s")
      if [ ! -s "$m" ]; then notes+="- FAIL: the $s-shaped model could not be made (logs/models.log)"$'\n'; b_failed=$((b_failed + 1)); continue; fi
      if [ "$(left)" -lt 60 ]; then notes+="- the $s-shaped model was made; loading it: $(skipped "out of time")"$'\n'; continue; fi
      timeout "$(cap 300)" "$bin" generate --device cpu --model "$m" --prompt "The capital of France is" --max-tokens 2 \
        --ignore-eos --json >"$work/runs/$s-cpu-load.json" 2>"$logs/$s-cpu-load.log" &&
        notes+="- the $s-shaped model ($(du -h "$m" | cut -f1)) was made and loads (CPU backend, 2 tokens)"$'\n' ||
        { notes+="- FAIL: the $s-shaped model does not load (logs/$s-cpu-load.log)"$'\n'; b_failed=$((b_failed + 1)); }
    done
    notes+="- $(skipped "dry run: bench-model on the 1B- and 8B-shaped models measures an NPU; the emulation says nothing about speed")"$'\n'
  else
    for s in "${shapes[@]}"; do
      m=$(shaped_model "$s")
      if [ ! -s "$m" ]; then rows+="| $s | FAIL: the model could not be made (logs/models.log) | | | | | |"$'\n'; b_failed=$((b_failed + 1)); continue; fi
      if [ "$(left)" -lt 60 ]; then rows+="| $s | $(skipped "out of time") | | | | | |"$'\n'; continue; fi
      say "bench-model $s"
      t=$(date +%s)
      if timeout "$(cap 400)" "$bin" bench-model --device ascend --model "$m" --json --skip-long --skip-roofline \
           --batches 1,32 --decode-steps 32 >"$work/runs/bench-$s.json" 2>"$logs/bench-$s.log"; then
        measured=$((measured + 1))
      else
        rc=$?
        if [ $rc = 124 ]; then
          notes+="- bench-model $s: $(skipped "out of time after $(($(date +%s) - t)) s")"$'\n'
        else
          notes+="- bench-model $s: FAIL: exit $rc: $(grep -m1 -iE 'error|panicked' "$logs/bench-$s.log" | cut -c1-200)"$'\n'
          b_failed=$((b_failed + 1))
        fi
        rows+="| $s | no figures (below) | | | | | |"$'\n'
        continue
      fi
      lb=""; lbb=""
      if [ -x "${LLAMA_CPP_CANN_BIN:-}/llama-bench" ] && [ "$(left)" -gt 30 ]; then
        say "llama.cpp (CANN) $s"
        timeout "$(cap 200)" "$LLAMA_CPP_CANN_BIN/llama-bench" -m "$m" -ngl 99 -p 512 -n 128 -r 3 -o json \
          >"$work/runs/llama-bench-$s.json" 2>"$logs/llama-bench-$s.log" && lb=$work/runs/llama-bench-$s.json
        if [ -x "$LLAMA_CPP_CANN_BIN/llama-batched-bench" ]; then
          timeout "$(cap 200)" "$LLAMA_CPP_CANN_BIN/llama-batched-bench" -m "$m" -ngl 99 -c 8192 -b 2048 -ub 512 \
            -npp 128 -ntg 32 -npl 1,32 >"$work/runs/llama-batched-$s.txt" 2>&1 && lbb=$work/runs/llama-batched-$s.txt
          cp "$work/runs/llama-batched-$s.txt" "$logs/llama-batched-$s.log" 2>/dev/null
        fi
      fi
      rows+="$("$tool" bench-row --label "$s, npu-serving ascend" --npu "$work/runs/bench-$s.json" \
                ${lb:+--llama-bench "$lb"} ${lbb:+--llama-batched "$lbb"})"$'\n'
      notes+="- $s: $(backend_of "$work/runs/bench-$s.json")"$'\n'
    done
    [ -x "${LLAMA_CPP_CANN_BIN:-}/llama-bench" ] ||
      notes+="- llama.cpp: $(skipped "no CANN build of llama.cpp given (LLAMA_CPP_CANN_BIN: a folder with llama-bench and llama-batched-bench built with -DGGML_CANN=ON)")"$'\n'
    notes+="- bench-model keeps the KV cache in 16-token blocks: prefill chunks then go token by token through the attention operator's incremental branch (its prompt branch needs 128-token blocks), so the prefill column is not the prompt branch's speed."$'\n'
  fi
  failed=$((failed + b_failed))
  {
    echo "## Speed: npu-serving bench-model --device ascend"
    echo
    echo "Random-weight Llama models made here (\`gpu_kit_tool shaped\`): 1B-class (hidden 2048, 16 layers, 32/8 heads, ff 8192) and 8B-class (hidden 4096, 32 layers, 32/8 heads, ff 14336), Q4_0 matrices, Q8_0 embedding and head, the default model's vocabulary (49,152). Tokens per second; f16 activations; decode at batch 32 is the total over the batch. npu-serving: \`bench-model --skip-long --batches 1,32\` (prefill of a 512-token prompt; decode at 128 tokens of context). llama.cpp (only with a CANN build given): \`llama-bench -ngl 99 -p 512 -n 128\` and \`llama-batched-bench -npp 128 -ntg 32 -npl 1,32\` (S_TG)."
    echo
    echo "| model | prefill 512 | llama.cpp pp512 | decode b1 | llama.cpp b1 | decode b32 | llama.cpp b32 |"
    echo "|---|---|---|---|---|---|---|"
    printf '%s' "$rows"
    echo
    printf '%s' "$notes"
    echo
  } >"$f"
  if [ $dry = 1 ]; then
    summary 40-bench "speed: SKIPPED (dry run: no NPU); the table's code ran as a smoke run on the emulation$([ $b_failed -gt 0 ] && echo ", $b_failed FAILED")"
  else
    summary 40-bench "speed: ${measured}/${#shapes[@]} shaped models measured$([ $b_failed -gt 0 ] && echo ", $b_failed FAILED")$([ -x "${LLAMA_CPP_CANN_BIN:-}/llama-bench" ] || echo '; llama.cpp SKIPPED (no CANN build given)')"
  fi
}

assemble() {
  local verdict skipped_n
  env_loaded
  skipped_n=$(cat "$work/skipped.count" 2>/dev/null | wc -l)
  [ $failed = 0 ] && verdict="no step failed" || verdict="$failed FAILED"
  {
    echo "# npu-serving NPU check ($mode)"
    echo
    echo "\`scripts/npu-check.sh$([ $dry = 1 ] && echo ' --dry-run') --budget $budget\`: the checks took $(($(date +%s) - started)) s of the budget (builds before them: $((started - t0)) s). Logs in logs/."
    echo
    echo "## Summary"
    echo
    cat "$work"/summary/*.txt 2>/dev/null | sed 's/^/- /'
    echo "- **npu-check: $verdict; $skipped_n SKIPPED$([ $dry = 1 ] && echo ' (dry run: nothing here ran on an NPU)')**"
    echo
    cat "$work"/report/*.md 2>/dev/null
  } >"$out/report.md"
  cp -r "$logs/." "$out/logs/" 2>/dev/null
  # Keep the folder small: long logs are cut to their last 200 kB.
  find "$out/logs" -type f -size +200k -exec sh -c 'tail -c 200000 "$1" >"$1.tail" && mv "$1.tail" "$1"' _ {} \;
  say "report: $out/report.md"
}

env_part
# The shaped models are written in the background (CPU work) while the device checks run.
make_models &
models_pid=$!
conformance_part
fidelity_part
wait "$models_pid"
bench_part
assemble
[ $failed = 0 ]
