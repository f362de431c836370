#!/usr/bin/env bash
# Runs one fuzz target under AFL++ (coverage-guided, on the stable toolchain through cargo-afl):
#   scripts/fuzz.sh TARGET [SECONDS]          (default 600 s; TARGET: see `scripts/fuzz.sh list`)
# Installs cargo-afl (which builds AFL++ from its crate) on first use, builds the instrumented
# driver into target/afl, seeds from fuzz/corpus/TARGET and fuzz/regressions/TARGET, and resumes
# an earlier run's queue in target/fuzz/TARGET. A 1 s limit per input (a longer one is a hang);
# the memory limit is 2 GiB for gguf and safetensors (nothing may be sized past the input; the
# gguf harness maps the input once) and 6 GiB for the others (they also map the tokenizers' model
# files); chat_template gets 3 s (its renders have a 2 s limit of their own).
# Findings land in target/fuzz/TARGET/default/{crashes,hangs}: minimise one with
#   cargo afl tmin -i CRASH -o fuzz/regressions/TARGET/NAME -- target/afl/release/npu-fuzz-afl TARGET
# and it is replayed by the test command from then on (fuzz/tests/replay.rs).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS="http api_bodies responses_bodies anthropic_bodies gguf tokenizer chat_template config_yaml agent_link kv_subscriber safetensors"
target=${1:-}
if [ -z "$target" ] || [ "$target" = list ]; then
  echo "targets: $TARGETS"
  [ -n "$target" ] && exit 0 || exit 2
fi
case " $TARGETS " in *" $target "*) ;; *) echo "fuzz.sh: unknown target $target (one of: $TARGETS)" >&2; exit 2 ;; esac
seconds=${2:-600}

if ! cargo afl --version >/dev/null 2>&1; then
  cargo install cargo-afl --version 0.18.2 --locked
fi
export CARGO_TARGET_DIR="$PWD/target/afl"
cargo afl build --release -p npu-fuzz --features afl --bin npu-fuzz-afl
bin="$CARGO_TARGET_DIR/release/npu-fuzz-afl"

# The models the harnesses read are fetched before the fuzzer starts its clock.
"$bin" "$target" < /dev/null >/dev/null 2>&1 || true

out="target/fuzz/$target"
mkdir -p "$out"
if [ -d "$out/default/queue" ]; then
  input=-   # resume the earlier queue
else
  input="$out/seeds"
  rm -rf "$input" && mkdir -p "$input"
  cp fuzz/corpus/"$target"/* "$input"/
  # Regressions that run into the 2 s template time limit are replayed by the tests, not fuzzed
  # from (every mutation of them would cost the whole limit).
  for f in fuzz/regressions/"$target"/*; do
    case "$f" in *time-limit*) ;; *) if [ -f "$f" ]; then cp "$f" "$input"/; fi ;; esac
  done
fi
mem=6144
case "$target" in gguf | safetensors) mem=2048 ;; esac
# A chat template's render has a 2 s time limit of its own (its thread is then left spinning,
# and the driver restarts): the hang limit sits above it, and the process restarts every 1000
# inputs in any case.
timeout_ms=1000
if [ "$target" = chat_template ]; then
  timeout_ms=3000
  export AFL_FUZZER_LOOPCOUNT=1000
fi
export AFL_SKIP_CPUFREQ=1 AFL_NO_UI=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_AFFINITY=1
export AFL_AUTORESUME=1
cargo afl fuzz -i "$input" -o "$out" -V "$seconds" -t "$timeout_ms" -m "$mem" -- "$bin" "$target"
stats="$out/default/fuzzer_stats"
if [ -f "$stats" ]; then
  grep -E '^(run_time|execs_done|execs_per_sec|corpus_count|edges_found|total_edges|bitmap_cvg|saved_crashes|saved_hangs)' "$stats"
fi
