import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite runs on strict lanes (dhelix/strand/strict.py): gloo kept to CUDA's and NCCL's
# rules, so a bug only a GPU would show fails here. Ranks inherit it; the tests of the
# plain gloo lanes set DHELIX_LANES=cpu themselves.
os.environ.setdefault("DHELIX_LANES", "strict")
os.environ.setdefault("DHELIX_STRICT_TIMEOUT", "60")


@pytest.fixture
def cpp_core():
    """The C++ planner core; CI builds it, so its absence fails (never skips) a test."""
    try:
        import dhelix._planner_core as core
    except ImportError as e:
        pytest.fail(f"the C++ planner extension did not build ({e}); `pip install -e .` "
                    f"compiles csrc/planner.cpp and needs a C++ compiler and pybind11")
    return core
