#!/usr/bin/env bash
# Triton's perf_analyzer, fetched from package registries into a cache folder, then run.
#
#   bench/perf_analyzer.sh --fetch          # fetch only (idempotent); prints the binary's path
#   bench/perf_analyzer.sh -m acme -i grpc ...   # run perf_analyzer with these arguments
#
# The `perf-analyzer` name on PyPI is a placeholder; the binary ships inside tritonclient wheels
# up to the 2.4x releases. This takes it from tritonclient 2.41.0 (manylinux x86_64) and the two
# shared libraries it links that the system lacks: libcudart.so.12 from the
# nvidia-cuda-runtime-cu12 wheel (loaded, never used: itif's KServe endpoint offers no CUDA
# shared memory, so no GPU or driver is needed) and libb64.so.0d from Debian's libb64-0d (the
# system's copy when it has one). Wheels are pinned by sha256; nothing is installed into the
# Python environment or the system.
#
# Cache: $ITIF_PERF_ANALYZER_DIR, default ${XDG_CACHE_HOME:-~/.cache}/itif/perf_analyzer-2.41.0.
# Python (for pip): $PYTHON, default python3.
set -euo pipefail

VERSION=2.41.0
DIR=${ITIF_PERF_ANALYZER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/itif/perf_analyzer-$VERSION}
PY=${PYTHON:-python3}
BIN=$DIR/bin/perf_analyzer

have_system_b64() { /sbin/ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d '; }

ready() {
    [[ -x $BIN && -e $DIR/lib/libcudart.so.12 ]] || return 1
    [[ -e $DIR/lib/libb64.so.0d ]] || have_system_b64
}

fetch() {
    if [[ $(uname -s)/$(uname -m) != Linux/x86_64 ]]; then
        echo "perf_analyzer.sh: the tritonclient $VERSION binary is for Linux x86_64 only" >&2
        return 1
    fi
    mkdir -p "$(dirname "$DIR")"
    tmp=$(mktemp -d "$DIR.tmp.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    cat >"$tmp/requirements.txt" <<EOF
tritonclient==$VERSION --hash=sha256:cf4ed5df836fa99937678a9fd852f86ba05c7b83656dd0a540e20afdb9ab4629
nvidia-cuda-runtime-cu12==12.3.101 --hash=sha256:04604679ddca6acb96c76a7a9306282cddc16981f92e148e2dfe227078883cda
EOF
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --platform manylinux1_x86_64 --require-hashes -r "$tmp/requirements.txt" -d "$tmp/wheels"
    mkdir -p "$tmp/out/bin" "$tmp/out/lib"
    "$PY" - "$tmp" <<'EOF'
import glob, os, sys, zipfile
tmp = sys.argv[1]
want = {"tritonclient-": ("tritonclient-2.41.0.data/data/bin/perf_analyzer", "bin/perf_analyzer"),
        "nvidia_cuda_runtime": ("nvidia/cuda_runtime/lib/libcudart.so.12", "lib/libcudart.so.12")}
for wheel in glob.glob(os.path.join(tmp, "wheels", "*.whl")):
    for prefix, (member, dest) in want.items():
        if os.path.basename(wheel).startswith(prefix):
            with zipfile.ZipFile(wheel) as z, open(os.path.join(tmp, "out", dest), "wb") as f:
                f.write(z.read(member))
EOF
    chmod +x "$tmp/out/bin/perf_analyzer"
    if ! have_system_b64; then
        # `apt-get download` needs no root, only the package lists; refresh them once if empty.
        if ! (cd "$tmp" && apt-get download -q libb64-0d >/dev/null 2>&1); then
            if [[ $(id -u) == 0 ]]; then apt-get update -qq >/dev/null; fi
            (cd "$tmp" && apt-get download -q libb64-0d >/dev/null)
        fi
        dpkg-deb -x "$tmp"/libb64-0d_*.deb "$tmp/deb"
        cp -L "$tmp"/deb/usr/lib/*/libb64.so.0d "$tmp/out/lib/"
    fi
    local out
    if ! out=$(LD_LIBRARY_PATH="$tmp/out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
            "$tmp/out/bin/perf_analyzer" --version 2>&1); then
        echo "perf_analyzer.sh: the fetched binary does not start: $out" >&2
        return 1
    fi
    rm -rf "$DIR"
    mv -T "$tmp/out" "$DIR"
    rm -rf "$tmp"
    trap - EXIT
}

ready || fetch
export LD_LIBRARY_PATH="$DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ ${1-} == --fetch ]]; then
    echo "$BIN"
    exit 0
fi
exec "$BIN" "$@"
