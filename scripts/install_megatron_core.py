"""Install a published megatron-core release into a folder of its own, for testing only.

    python scripts/install_megatron_core.py 0.19.2 --target .mcore-0.19.2
    PYTHONPATH=$PWD/.mcore-0.19.2 python -m pytest -m mcore_equiv tests

Why: megatron-core 0.17 and later declare Python >= 3.12, so pip on Python 3.11 (these
machines) offers none of them and their sdists refuse to build. Their wheels are pure
Python but for one dataset helper, and run on 3.11. This script takes the published wheel
from the package index (`pip download`, nothing kept in this repository), unpacks it into
TARGET, rebuilds the helper (`megatron/core/datasets/helpers.cpp`) for this interpreter
with pybind11, and checks that `import megatron.core` reports the version. The installed
megatron-core in site-packages is not touched: only processes started with TARGET first on
PYTHONPATH see the other version.

On Python 3.12 and later none of this is needed: `pip install megatron-core==0.19.2`.

Megatron-LM's training code at tag core_v0.19.0 uses `typing.override` (3.12). On an
older Python the folder also gets a `sitecustomize.py` that fills it in from
typing_extensions, so `pretrain_gpt.py` imports; DHelix itself does not need it.
"""
from __future__ import annotations

import argparse
import glob
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

# the Megatron-LM tag whose training code pairs with each megatron-core release tested
PAIRED_TAG = {"0.16.1": "core_v0.16.1", "0.19.2": "core_v0.19.0"}

SITECUSTOMIZE = '''\
# Written by DHelix's scripts/install_megatron_core.py, for testing only: Megatron-LM's
# training code (core_v0.19.0) imports typing.override, new in Python 3.12.
import typing
if not hasattr(typing, "override"):
    import typing_extensions
    typing.override = typing_extensions.override
'''


def say(msg):
    print(f"install_megatron_core: {msg}", flush=True)


def fail(msg):
    sys.exit(f"install_megatron_core: {msg}")


def download(version: str, into: str) -> str:
    """The release's wheel for CPython 3.12 on this machine's architecture."""
    arch = platform.machine()
    plats = [f"manylinux_2_{n}_{arch}" for n in (28, 27, 24, 17)] + [f"manylinux2014_{arch}"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", into,
           f"megatron-core=={version}"]
    for p in plats:
        cmd += ["--platform", p]
    say(f"downloading megatron-core {version} (the cp312 wheel for {arch})")
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheels = glob.glob(os.path.join(into, "megatron_core-*.whl"))
    if r.returncode != 0 or not wheels:
        fail(f"pip download megatron-core=={version} failed (exit {r.returncode}):\n"
             f"{r.stderr.strip()[-2000:]}")
    return wheels[0]


def build_helpers(target: str) -> None:
    """Rebuild megatron's dataset index helper for this interpreter (the wheel's is 3.12's)."""
    ddir = os.path.join(target, "megatron", "core", "datasets")
    src = os.path.join(ddir, "helpers.cpp")
    if not os.path.exists(src):
        fail(f"{src} is missing from the wheel: cannot build the dataset helper")
    for so in glob.glob(os.path.join(ddir, "helpers_cpp.*.so")):
        os.remove(so)
    try:
        import pybind11
    except ImportError:
        fail("pybind11 is needed to build megatron's dataset helper: pip install pybind11")
    out = os.path.join(ddir, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    cxx = os.environ.get("CXX", "g++")
    cmd = [cxx, "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC",
           f"-I{sysconfig.get_paths()['include']}", f"-I{pybind11.get_include()}",
           src, "-o", out]
    say(f"building {os.path.relpath(out, target)} for Python "
        f"{sys.version_info.major}.{sys.version_info.minor}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"building the dataset helper failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")


def check(target: str, version: str) -> None:
    code = ("import megatron.core, megatron.core.datasets.helpers_cpp, importlib.metadata as m;"
            "print(megatron.core.__version__, m.version('megatron-core'), "
            "megatron.core.__file__)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [target] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        fail(f"`import megatron.core` from {target} failed:\n{r.stderr.strip()[-2000:]}\n"
             f"(megatron-core 0.19 imports triton at module level: pip install triton)")
    got, dist, path = r.stdout.split()
    got = got.split("+")[0]     # megatron appends the git hash of a checkout it lies in
    if got != version or dist != version or not path.startswith(os.path.abspath(target)):
        fail(f"{target} imports megatron-core {got} (metadata {dist}) from {path}, "
             f"not {version}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("version", help="a published megatron-core release, e.g. 0.19.2")
    p.add_argument("--target", help="the folder to install into (default .mcore-VERSION in "
                                    "the repository root); replaced if it exists")
    a = p.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    target = os.path.abspath(a.target or os.path.join(root, f".mcore-{a.version}"))
    stamp = os.path.join(target, ".installed")
    if os.path.exists(stamp) and open(stamp).read().strip() == a.version:
        check(target, a.version)
        say(f"megatron-core {a.version} already in {target}")
    else:
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
        with tempfile.TemporaryDirectory() as tmp:
            with zipfile.ZipFile(download(a.version, tmp)) as z:
                z.extractall(target)
        if sys.version_info < (3, 12):
            build_helpers(target)
            with open(os.path.join(target, "sitecustomize.py"), "w") as f:
                f.write(SITECUSTOMIZE)
        check(target, a.version)
        with open(stamp, "w") as f:
            f.write(a.version + "\n")
        say(f"megatron-core {a.version} installed in {target}")
    tag = PAIRED_TAG.get(a.version)
    say(f"use it with: PYTHONPATH={target}" +
        (f"  (Megatron-LM's training code: tag {tag})" if tag else ""))


if __name__ == "__main__":
    main()
