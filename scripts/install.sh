#!/usr/bin/env bash
# Installs everything horovod-safusion needs on a bare Debian 12 machine, idempotently:
#   Debian packages (Open MPI, compilers, cmake, iproute2, OpenSSH for the cluster on one
#   machine), a virtual environment with
#   torch, the scientific stack, mpi4py and Horovod 0.28.1 (PyTorch + Gloo + MPI),
#   and this package in editable mode.
# Horovod 0.28.1 ships only as an sdist that needs C++17 against current PyTorch; the built
# wheel is cached outside the repository, keyed by Horovod, torch and Python versions and our
# patch level, so a second install takes seconds.
# Patch "gil1": Horovod's PyTorch binding holds the GIL while it enqueues a collective, and its
# background thread, shutting down after a peer died (Horovod elastic), holds the process-set
# table lock while it drops tensors, which needs the GIL: the two deadlock (seen in about 1 of 4
# elastic recoveries here). The async enqueue functions now release the GIL, as Horovod already
# does for waiting (horovod/horovod#3353); they touch no Python object.
set -euo pipefail

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
HVD_VERSION=0.28.1
HVD_PATCHES=gil1
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TRITON_VERSION=${TRITON_VERSION:-3.6.0}  # the last version checked under TRITON_INTERPRET=1 (tests)
CACHE=${HOROVOD_SAFUSION_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/horovod-safusion}

log() { printf '\033[1m[install]\033[0m %s\n' "$*"; }

# ---- 1. Debian packages ---------------------------------------------------------------
apt_pkgs=(libopenmpi-dev openmpi-bin cmake g++ make iproute2 openssh-server openssh-client)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  log "apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# ---- 2. virtual environment -----------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    # A machine that already has torch (e.g. a CUDA build on a GPU machine): keep it.
    log "creating $VENV on top of the system torch"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY="$(cd "$VENV" && pwd)/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  log "pip install torch==$TORCH_VERSION"
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
log "pip install the scientific stack"
"${PIP[@]}" numpy scipy numba matplotlib tqdm pytest pytest-timeout hypothesis scikit-learn \
  cloudpickle psutil pyyaml packaging cffi mpi4py wheel setuptools
# Triton is optional at run time (GPU kernels); the tests run its kernels on CPU tensors through
# its interpreter, so they need it installed
"${PIP[@]}" "triton==$TRITON_VERSION"

# ---- 3. Horovod (cached wheel) --------------------------------------------------------
have_hvd() {
  "$PY" - <<PYEOF >/dev/null 2>&1
import horovod, horovod.torch as hvd
assert horovod.__version__ == "$HVD_VERSION"
assert hvd.gloo_built() and hvd.mpi_built()
import os
with open(os.path.join(os.path.dirname(horovod.__file__), "SAFUSION_PATCHES")) as f:
    assert f.read().strip() == "$HVD_PATCHES"
PYEOF
}
if ! have_hvd; then
  key=$("$PY" -c "import sys, torch; print(f'horovod-$HVD_VERSION-$HVD_PATCHES-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}')")
  wheeldir="$CACHE/wheels/$key"
  if ! ls "$wheeldir"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HVD_VERSION against torch (about 6 minutes on 2 cores) -> $wheeldir"
    build=$(mktemp -d)
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
      -d "$build" "horovod==$HVD_VERSION"
    tar -xzf "$build"/horovod-"$HVD_VERSION".tar.gz -C "$build"
    src="$build/horovod-$HVD_VERSION"
    # PyTorch >= 2.1 headers require C++17; the sdist pins C++14 in two places.
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    # gil1: release the GIL in every async enqueue of the PyTorch binding (see the top)
    perl -0pi -e 's/(m\.def\("horovod_torch_\w+_async_torch_\w+",\s*&Do\w+)\);/$1, py::call_guard<py::gil_scoped_release>());/g' \
      "$src/horovod/torch/mpi_ops_v2.cc"
    grep -q 'gil_scoped_release>());' "$src/horovod/torch/mpi_ops_v2.cc" || { echo "the gil1 patch did not apply" >&2; exit 1; }
    mkdir -p "$wheeldir"
    (cd "$src" && HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
      HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
      -w "$wheeldir" .)
    rm -rf "$build"
  fi
  log "installing cached Horovod wheel from $wheeldir"
  "${PIP[@]}" --no-deps --force-reinstall "$wheeldir"/horovod-*.whl
  echo "$HVD_PATCHES" > "$("$PY" -c 'import horovod, os; print(os.path.dirname(horovod.__file__))')/SAFUSION_PATCHES"
  have_hvd || { echo "Horovod installed but horovod.torch does not import with Gloo and MPI" >&2; exit 1; }
fi

# ---- 4. this package ------------------------------------------------------------------
log "installing horovod-safusion (editable)"
"${PIP[@]}" --no-deps --no-build-isolation -e .
log "compiling the selection kernels (Numba caches them in the package)"
"$PY" -c "from horovod_safusion.compressors.segmented import warm_up; warm_up(); from horovod_safusion.kernels.host import warm_up; warm_up()"
log "done: $("$PY" -c 'import torch, horovod; print(f"torch {torch.__version__}, horovod {horovod.__version__}")')"
