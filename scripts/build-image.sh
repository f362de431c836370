#!/usr/bin/env bash
# Builds the container image of deploy/Containerfile with podman, then (unless --no-smoke) runs it
# once as Kubernetes would: the ConfigMap's config mounted, the model in a volume, /dev/shm
# sized, non-root; waits for /ready, generates, reads /metrics, stops it with SIGTERM and checks
# that it drained and exited 0.
#
#   scripts/build-image.sh                        # base images from the registry (rust, debian)
#   scripts/build-image.sh --local-base           # base images made here from Debian packages
#   scripts/build-image.sh --features cuda,ascend --tag npu-serving:devices
#   scripts/build-image.sh --smoke-only           # the smoke run of an image already built
#
# --local-base is for machines that reach Debian's archive but no container registry: it makes
# two base images with debootstrap (a minbase bookworm for the run stage; the same plus gcc and
# this machine's Rust toolchain, copied from `rustc --print sysroot`, for the build stage) and
# imports them as localhost/npu-serving-base:{run,build}. They are cached (rootfs tarballs under
# ~/.cache/npu-serving/image); --rebuild-base makes them again.
#
# Needs podman (and for --local-base, debootstrap), root or sudo for apt-get if they are missing.
# The first build takes a while (a release build of the workspace in the container: about 10
# minutes on 2 cores); cargo's registry and target are build caches, so later builds are faster.
# Not run by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

features=""
tag="localhost/npu-serving:dev"
local_base=0
rebuild_base=0
smoke=1
smoke_only=0
while [ $# -gt 0 ]; do
    case "$1" in
        --features) features="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        --local-base) local_base=1; shift ;;
        --rebuild-base) rebuild_base=1; local_base=1; shift ;;
        --no-smoke) smoke=0; shift ;;
        --smoke-only) smoke_only=1; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "build-image.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

sudo_if_needed() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
need_pkg() { # command package
    if ! command -v "$1" >/dev/null 2>&1; then
        echo "build-image.sh: installing $2 (apt-get)" >&2
        sudo_if_needed apt-get update -qq
        sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
    fi
}
need_pkg podman podman

cache="${XDG_CACHE_HOME:-$HOME/.cache}/npu-serving/image"
mkdir -p "$cache"

# The Debian mirror this machine's apt uses (so the base is made from the same archive).
debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
    local uri=""
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    fi
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri=$(awk '$1 == "deb" && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list)
    fi
    [ -n "$uri" ] || { echo "build-image.sh: no Debian mirror found in /etc/apt; set DEBIAN_MIRROR" >&2; exit 1; }
    echo "$uri"
}

# make_base NAME INCLUDE_PACKAGES: a debootstrap minbase bookworm, cleaned, as a tarball.
make_rootfs() {
    local name="$1" include="$2" tarball="$cache/$1.tar"
    if [ -f "$tarball" ] && [ "$rebuild_base" = 0 ]; then return; fi
    need_pkg debootstrap debootstrap
    local root
    root=$(mktemp -d "$cache/rootfs-$name.XXXX")
    echo "build-image.sh: debootstrap bookworm ($name) into $root" >&2
    sudo_if_needed debootstrap --variant=minbase ${include:+--include="$include"} bookworm "$root" "$(debian_mirror)" >"$cache/debootstrap-$name.log" 2>&1 ||
        { echo "build-image.sh: debootstrap failed, see $cache/debootstrap-$name.log" >&2; exit 1; }
    sudo_if_needed chroot "$root" apt-get clean
    sudo_if_needed rm -rf "$root"/var/lib/apt/lists/* "$root"/usr/share/doc "$root"/usr/share/man \
        "$root"/usr/share/locale "$root"/var/cache/debconf/*-old "$root"/var/log/*
    sudo_if_needed tar -C "$root" -cf "$tarball.tmp" .
    sudo_if_needed rm -rf "$root"
    mv "$tarball.tmp" "$tarball"
}

if [ "$smoke_only" = 0 ]; then
build_args=()
# RUN steps in a chroot instead of an OCI runtime container: where no container can be created
# (seen here: crun and runc refuse this machine's hybrid cgroups and its rlimits), buildah's chroot
# isolation still builds. BUILD_ISOLATION=oci (or chroot) overrides; default: chroot with
# --local-base, podman's default otherwise.
isolation=()
iso="${BUILD_ISOLATION:-$([ "$local_base" = 1 ] && echo chroot || echo "")}"
[ -n "$iso" ] && isolation=(--isolation "$iso")
if [ "$local_base" = 1 ]; then
    make_rootfs run ""
    make_rootfs build "gcc,libc6-dev,ca-certificates"
    if [ "$rebuild_base" = 1 ] || ! podman image exists localhost/npu-serving-base:run; then
        podman import --change 'CMD ["/bin/bash"]' "$cache/run.tar" localhost/npu-serving-base:run >/dev/null
    fi
    if [ "$rebuild_base" = 1 ] || ! podman image exists localhost/npu-serving-base:build; then
        # The build base: the build rootfs plus this machine's Rust toolchain at /usr/local/rust,
        # laid out like the official rust images (CARGO_HOME /usr/local/cargo).
        sysroot="$(rustc --print sysroot)"
        echo "build-image.sh: build base with $(rustc --version) from $sysroot" >&2
        ctx=$(mktemp -d "$cache/buildbase.XXXX")
        cp "$cache/build.tar" "$ctx/rootfs.tar"
        tar -C "$sysroot" --exclude=./share/doc -cf "$ctx/rust.tar" .
        # The CAs this machine trusts (cargo fetches crates through the same network; a machine
        # behind a TLS-inspecting proxy has that proxy's CA here). Build stage only.
        cp "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$ctx/ca-certificates.crt"
        cat >"$ctx/Containerfile" <<'EOF'
FROM scratch
ADD rootfs.tar /
ADD rust.tar /usr/local/rust/
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    CARGO_HOME=/usr/local/cargo
RUN mkdir -p /usr/local/cargo/bin && cargo --version && rustc --version && cc --version | head -1
EOF
        podman build --quiet "${isolation[@]}" -t localhost/npu-serving-base:build "$ctx" >/dev/null
        rm -rf "$ctx"
    fi
    build_args+=(--build-arg BUILDER=localhost/npu-serving-base:build
                 --build-arg RUNTIME=localhost/npu-serving-base:run)
fi

echo "build-image.sh: podman build $tag (features: ${features:-none})" >&2
start=$(date +%s)
podman build -f deploy/Containerfile --network host "${isolation[@]}" --build-arg FEATURES="$features" \
    "${build_args[@]}" -t "$tag" .
echo "build-image.sh: built $tag in $(( $(date +%s) - start )) s; $(podman image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')" >&2
fi

[ "$smoke" = 1 ] || exit 0

# --- Smoke run, as the Deployment runs it -------------------------------------------------------
# The model: the default model from this machine's cache (fetched here first if absent), copied
# into a volume the container sees as $NPU_SERVING_CACHE/models, as the init step leaves it.
model_dir="$cache/smoke-models"
mkdir -p "$model_dir"
if [ ! -f "$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    host_model="${XDG_CACHE_HOME:-$HOME/.cache}/npu-serving/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    [ -f "$host_model" ] || deploy/kubernetes/base/fetch-model.sh "${XDG_CACHE_HOME:-$HOME/.cache}/npu-serving"
    cp "$host_model" "$model_dir/"
fi
chmod -R a+rwX "$model_dir"
port=18835
fail() { echo "build-image.sh: SMOKE FAILED: $*" >&2; [ -n "${logs:-}" ] && tail -30 "$logs" >&2; exit 1; }
logs=$(mktemp)
if podman run --rm --entrypoint /bin/true "$tag" >/dev/null 2>&1; then
    # A container, as the kubelet would start it: read-only root, non-root, /dev/shm sized.
    name="npu-serving-smoke-$$"
    podman run -d --name "$name" --network host --shm-size 1g --user 10001:10001 --read-only \
        --tmpfs /tmp \
        -v "$PWD/deploy/kubernetes/base/config/server.yaml:/etc/npu-serving/config.yaml:ro" \
        -v "$model_dir:/var/cache/npu-serving/models" \
        "$tag" --config /etc/npu-serving/config.yaml --port "$port" >/dev/null
    cleanup() { podman logs "$name" >"$logs" 2>&1 || true; podman rm -f "$name" >/dev/null 2>&1 || true; }
    running() { [ "$(podman inspect --format '{{.State.Running}}' "$name")" = true ]; }
    as_user() { podman exec "$name" id -u; }
    stop_it() { podman stop --time 60 "$name" >/dev/null; code=$(podman inspect --format '{{.State.ExitCode}}' "$name"); }
    how="podman run"
else
    # No container can be created here (see BUILD_ISOLATION above): run the image's own root
    # filesystem instead, exported from the image, in a private mount namespace, chrooted, as uid
    # 10001, with the same mounts. The binary, its libraries and its user are the image's; the
    # isolation is not a container's.
    [ "$(id -u)" = 0 ] || fail "podman cannot create containers here and the chroot fallback needs root"
    rootfs=$(mktemp -d)
    chmod 0755 "$rootfs"
    cid=$(podman create "$tag")
    podman export "$cid" | tar -x -C "$rootfs"
    podman rm "$cid" >/dev/null
    mkdir -p "$rootfs/var/cache/npu-serving/models"
    unshare --mount sh -c '
        set -e; r="$1"
        mount --rbind /dev "$r/dev"; mount -t tmpfs -o size=1g tmpfs "$r/dev/shm"
        mount -t proc proc "$r/proc"; mount -t tmpfs tmpfs "$r/tmp"
        mount --bind "$2" "$r/etc/npu-serving/config.yaml"; mount --bind "$3" "$r/var/cache/npu-serving/models"
        mount -o remount,bind,ro "$r/etc/npu-serving/config.yaml"
        exec chroot --userspec=10001:10001 "$r" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin \
            HOME=/var/lib/npu-serving NPU_SERVING_CACHE=/var/cache/npu-serving \
            /usr/local/bin/npu-serving serve --config /etc/npu-serving/config.yaml --port "$4"' \
        sh "$rootfs" "$PWD/deploy/kubernetes/base/config/server.yaml" "$model_dir" "$port" >"$logs" 2>&1 &
    pid=$!
    cleanup() { kill -KILL "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$rootfs"; }
    running() { kill -0 "$pid" 2>/dev/null; }
    as_user() { awk '/^Uid:/ {print $2}' "/proc/$pid/status"; }
    stop_it() { kill -TERM "$pid"; code=0; wait "$pid" || code=$?; }
    how="the image's root filesystem, chrooted (podman could not create a container here)"
fi
trap cleanup EXIT
echo "build-image.sh: smoke run in $how" >&2
until curl -fsS "localhost:$port/ready" >/dev/null 2>&1; do
    running || fail "the server exited"
    sleep 1
done
echo "build-image.sh: /ready 200; /live $(curl -s -o /dev/null -w '%{http_code}' "localhost:$port/live")" >&2
[ "$(as_user)" = 10001 ] || fail "not running as uid 10001"
out=$(curl -fsS "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt":"The capital of France is","max_tokens":8,"temperature":0}') || fail "completion"
echo "build-image.sh: completion: $out" >&2
curl -fsS "localhost:$port/metrics" | grep -E '^npu_serving_(requests_waiting|requests_running|kv_cache_usage_perc) ' >&2 ||
    fail "metrics the endpoint picker reads are missing"
t0=$(date +%s)
stop_it
echo "build-image.sh: SIGTERM -> exit $code after $(( $(date +%s) - t0 )) s" >&2
[ "$code" = 0 ] || fail "exit code $code after SIGTERM"
echo "build-image.sh: smoke run passed" >&2
