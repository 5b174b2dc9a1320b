#!/usr/bin/env bash
# The Python package: builds and installs it with `pip install .` (scikit-build-core + nanobind,
# fetched from PyPI into pip's isolated build environment) into a virtual environment, then runs
# the pytest suite (tests/python) against PyTorch, in two virtual environments:
#
# 1. Debian's torch (the chapter's oracle) for everything but tests/python/torch_ops;
# 2. attn.torch's suite (tests/python/torch_ops: the custom op, autograd, torch.compile, the
#    patch inside Hugging Face models) against torch and transformers from PyPI, pinned to the
#    versions it was written against, in .cache/torch-venv. PyPI's Linux torch wheel pulls the
#    CUDA libraries too (about 5 GB, ~100 s here); pip's cache is off, so nothing is reused
#    across runs. ATTN_TORCH_OPS_REQUIRED=1 makes a missing dependency fail, not skip.
#
# attn is built once, as a wheel, and installed into both.
#
# PyTorch: Debian's python3-torch (1.13, CPU-only, from apt) -- it installs reliably in about a
# minute, where PyPI's default torch wheel pulls several GB of CUDA libraries. The venv
# (.cache/py-venv, Debian's /usr/bin/python3) is created with --system-site-packages so that it
# sees Debian's torch, numpy and pytest; only attn itself and ml_dtypes are installed into it.
#
# ml_dtypes (PyPI): the bfloat16 NumPy dtype (NumPy has none; JAX's), which attn takes and returns
# for bfloat16 -- the tests compare bf16 results with it. Installed with numpy pinned to the
# version the venv already sees, so pip never pulls a NumPy that Debian's torch was not built for.
# Fails if torch cannot be imported (the comparisons with PyTorch must not be skipped in CI).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/install-deps.sh" python3-dev python3-venv python3-pip python3-numpy python3-pytest python3-torch
venv="$root/.cache/py-venv"
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv"
numpy_version="$("$venv/bin/python" -c 'import numpy; print(numpy.__version__)')"
"$venv/bin/python" -m pip install -q --disable-pip-version-check ml_dtypes \
  --constraint <(echo "numpy==$numpy_version")
started=$SECONDS
wheels="$(mktemp -d)"
"$venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$wheels" "$root"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheels"/attn-*.whl
echo "test_python: pip wheel . and install took $((SECONDS - started)) s"
"$venv/bin/python" -c 'import torch; print("test_python: torch", torch.__version__)'
"$venv/bin/python" -c 'import ml_dtypes; print("test_python: ml_dtypes", ml_dtypes.__version__)'
# From outside the tree, so `import attn` is the installed package, not python/attn.
cd "$(mktemp -d)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -rs "$root/tests/python" \
  --ignore="$root/tests/python/torch_ops"

torch_venv="$root/.cache/torch-venv"
[ -x "$torch_venv/bin/python" ] || /usr/bin/python3 -m venv "$torch_venv"
started=$SECONDS
"$torch_venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
  torch==2.15.0 transformers==5.23.0 pytest numpy
"$torch_venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheels"/attn-*.whl
echo "test_python: torch-venv (torch, transformers from PyPI, attn's wheel) took $((SECONDS - started)) s"
"$torch_venv/bin/python" -c 'import torch, transformers; print("test_python: torch", torch.__version__, "transformers", transformers.__version__)'
ATTN_TORCH_OPS_REQUIRED=1 "$torch_venv/bin/python" -m pytest -q -p no:cacheprovider -rs "$root/tests/python/torch_ops"
