#!/usr/bin/env bash
# Offline check of deploy/kubernetes: renders each overlay (cpu, ascend, cuda) with kustomize and
# validates every object against the Kubernetes, Gateway API and InferencePool schemas with
# unknown fields refused, then checks the objects against each other and against the server
# (scripts/deploy-check/validate.py says what exactly). Then the self-test: copies of the
# manifests with one deliberate mistake each (a misspelt field at several depths, a grace period
# shorter than the drain) must each FAIL the same check.
#
# What it installs, once, under ~/.cache/npu-serving/deploy-check ($XDG_CACHE_HOME is honoured;
# nothing in the repository, nothing system-wide):
#   - kubectl 1.20 from Debian's kubernetes-client package (`apt-get download`, unpacked with
#     dpkg-deb -x), for `kubectl kustomize` (kustomize v2.0.3);
#   - a Python virtual environment with scripts/deploy-check/requirements.txt
#     (kubernetes-validate: Kubernetes' OpenAPI schemas as JSON schemas);
#   - npm packages of scripts/deploy-check/package.json (@kubernetes-models/gateway-api: the
#     Gateway API's generated types and validator; typescript for tsc).
# Needs apt-get (a Debian machine), python3 with venv, node and npm. Run by scripts/test.sh.
#   scripts/check-deploy.sh              # check and self-test
#   scripts/check-deploy.sh --no-self-test
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
self_test=1
[ "${1:-}" = --no-self-test ] && self_test=0

started=$(date +%s)
cache="${XDG_CACHE_HOME:-$HOME/.cache}/npu-serving/deploy-check"
mkdir -p "$cache"
say() { echo "check-deploy: $*" >&2; }

# --- Tools --------------------------------------------------------------------------------------
kubectl="$cache/kubernetes-client/usr/bin/kubectl"
if [ ! -x "$kubectl" ]; then
    say "fetching Debian's kubernetes-client (kubectl 1.20, kustomize v2.0.3) into $cache"
    tmp=$(mktemp -d)
    if ! (cd "$tmp" && apt-get download kubernetes-client >/dev/null 2>&1); then
        # The package lists may be missing or stale on a fresh machine.
        if [ "$(id -u)" = 0 ]; then apt-get update -qq; else sudo apt-get update -qq; fi
        (cd "$tmp" && apt-get download kubernetes-client >/dev/null)
    fi
    rm -rf "$cache/kubernetes-client"
    dpkg-deb -x "$tmp"/kubernetes-client_*.deb "$cache/kubernetes-client"
    rm -rf "$tmp"
fi

venv="$cache/venv"
req="scripts/deploy-check/requirements.txt"
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$req" "$venv/requirements.txt"; then
    say "installing $req into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
    cp "$req" "$venv/requirements.txt"
fi

npm_dir="$cache/npm"
if [ ! -x "$npm_dir/node_modules/.bin/tsc" ] || ! cmp -s scripts/deploy-check/package.json "$npm_dir/package.json"; then
    say "installing scripts/deploy-check/package.json's packages into $npm_dir"
    rm -rf "$npm_dir"
    mkdir -p "$npm_dir"
    cp scripts/deploy-check/package.json "$npm_dir/"
    # @kubernetes-models 2.x asks for Node.js 22 in its engines field; its types and validators
    # run on Node.js 20 (Debian's and this project's machines), hence --engine-strict=false.
    (cd "$npm_dir" && npm install --silent --no-audit --no-fund --engine-strict=false \
        --omit-lockfile-registry-resolved >/dev/null 2>&1) ||
        { say "npm install failed in $npm_dir"; exit 1; }
fi
tools_done=$(date +%s)

# --- Render and validate --------------------------------------------------------------------------
# render_and_validate TREE: renders TREE/overlays/* and validates them; the validator's status.
render_and_validate() {
    local tree="$1" out
    out=$(mktemp -d)
    local renders=()
    for overlay in cpu ascend cuda; do
        if ! "$kubectl" kustomize "$tree/overlays/$overlay" >"$out/$overlay.yaml" 2>"$out/$overlay.err"; then
            echo "check-deploy: FAIL $overlay: kustomize: $(tail -1 "$out/$overlay.err")"
            rm -rf "$out"
            return 1
        fi
        renders+=("$overlay=$out/$overlay.yaml")
    done
    local status=0
    "$venv/bin/python" scripts/deploy-check/validate.py --repo "$repo" --npm "$npm_dir" "${renders[@]}" || status=$?
    rm -rf "$out"
    return $status
}

if ! render_and_validate deploy/kubernetes; then
    say "deploy/kubernetes FAILED"
    exit 1
fi
checked=$(date +%s)

# --- Self-test: each mistake must fail the check ---------------------------------------------------
# All mistaken copies are validated in one run (one tsc); each one's problems come back under its
# own label, and each must name the mistake.
if [ "$self_test" = 1 ]; then
    # file|overlay to render|sed expression|what the failure must mention
    mistakes=(
        "base/deployment.yaml|cpu|s/^  replicas: 2/  replicass: 2/|replicass"
        "base/deployment.yaml|cpu|s/^          readinessProbe:/          readynessProbe:/|readynessProbe"
        "base/deployment.yaml|cpu|s/^      terminationGracePeriodSeconds: 45/      terminationGracePeriodSeconds: 30/|terminationGracePeriodSeconds 30"
        "base/deployment.yaml|cpu|s/^              path: \/live/              path: \/healthz/|livenessProbe: path '/healthz'"
        "base/pdb.yaml|cpu|s/^  maxUnavailable: 1/  maxUnavailible: 1/|maxUnavailible"
        "base/service.yaml|cpu|s/^      targetPort: http/      targetport: http/|targetport"
        "base/inferencepool.yaml|cpu|s/^  endpointPickerRef:/  extensionRef:/|extensionRef"
        "base/inferencepool.yaml|cpu|s/^      number: 9002/      portNumber: 9002/|portNumber"
        "base/httproute.yaml|cpu|s/^      backendRefs:/      backendRef:/|backendRef"
        "base/httproute.yaml|cpu|s/^          kind: InferencePool/          kind: InferencePool\n          weigth: 1/|weigth"
        "base/epp.yaml|cpu|s/^            - npu-serving-smollm2$/            - npu-serving-other/|--pool-name npu-serving-other"
        "overlays/ascend/deployment-patch.yaml|ascend|s/^              huawei.com\/Ascend910: \"1\"/              huawei.com\/Ascend910: \"1\"\n              nvidia.com\/gpu: \"1\"/|nvidia.com/gpu requested in overlay ascend"
    )
    failed=0
    work=$(mktemp -d)
    renders=()
    for i in "${!mistakes[@]}"; do
        IFS='|' read -r file overlay expr want <<<"${mistakes[$i]}"
        tree="$work/tree$i"
        mkdir -p "$tree"
        cp -r deploy/kubernetes/. "$tree/"
        sed -i "$expr" "$tree/$file"
        if cmp -s "deploy/kubernetes/$file" "$tree/$file"; then
            say "self-test: the edit '$expr' changed nothing in $file"
            failed=1
        elif ! "$kubectl" kustomize "$tree/overlays/$overlay" >"$work/case$i.yaml" 2>"$work/case$i.err"; then
            say "self-test: case $i ($file: $expr) does not render: $(tail -1 "$work/case$i.err")"
            failed=1
        else
            renders+=("case$i:$overlay=$work/case$i.yaml")
        fi
    done
    out=$("$venv/bin/python" scripts/deploy-check/validate.py --repo "$repo" --npm "$npm_dir" "${renders[@]}" 2>&1) || true
    for i in "${!mistakes[@]}"; do
        IFS='|' read -r file overlay expr want <<<"${mistakes[$i]}"
        caught=$(grep -F "FAIL case$i: " <<<"$out" | grep -F -- "$want" | head -1 || true)
        if [ -z "$caught" ]; then
            say "self-test: NOT caught: $file: $expr (expected a failure naming '$want')"
            grep -F "FAIL case$i: " <<<"$out" >&2 || true
            failed=1
        else
            say "self-test: caught ${caught#check-deploy: FAIL case$i: }"
        fi
    done
    rm -rf "$work"
    [ "$failed" = 0 ] || { say "self-test FAILED"; exit 1; }
fi
done_at=$(date +%s)
say "passed: tools $((tools_done - started)) s, check $((checked - tools_done)) s, self-test $((done_at - checked)) s"
