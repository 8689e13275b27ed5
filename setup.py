"""DHelix: strand interleaving for megatron-core (see README.md)."""
import os

from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
    ext_modules = [Pybind11Extension("dhelix._planner_core", ["csrc/planner.cpp"],
                                     cxx_std=17, extra_compile_args=["-O2"])]
    cmdclass = {"build_ext": build_ext}
except ImportError:  # no pybind11: the pure-Python planner is used
    ext_modules, cmdclass = [], {}
if not os.path.exists("csrc/planner.cpp"):
    ext_modules = []

setup(
    name="dhelix",
    version="0.1.0",
    description="Strand interleaving for megatron-core: hide communication behind computation",
    packages=find_packages(include=["dhelix", "dhelix.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        # Tested with 0.16.1 (Python >= 3.10; Megatron-LM tag core_v0.16.1) and 0.19.2
        # (Python >= 3.12 as published; Megatron-LM tag core_v0.19.0): README "Install".
        # pip on Python 3.11 finds no release after 0.16.1, so it keeps 0.16.1 there.
        "megatron-core>=0.15,<0.20",
        "numpy",
        "pyyaml",
        "matplotlib",
        "tqdm",
        "psutil",       # megatron's checkpoint writer (dist_checkpointing) needs it
    ],
    extras_require={
        # the test suite also imports Megatron-LM's training code (megatron.training needs
        # these beside megatron-core)
        # (pybind11: scripts/install_megatron_core.py builds megatron's dataset helper)
        # (pytest-xdist: CI runs the suite's files on two workers, `.ci/run`)
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist", "hypothesis", "six",
                 "regex", "triton", "pydantic", "pybind11"],
        "megatron-lm": ["six", "regex", "triton", "pydantic"],
        "gpu": ["transformer-engine", "apex"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["dhelix=dhelix.cli:main"]},
    include_package_data=True,
)
