"""megatron-core 0.16.1 and 0.19.2 side by side (`dhelix/compat/mcore.py`).

The suite runs on the megatron-core pip installs here (0.16.1 on Python 3.11); `.ci/run`
then runs the equivalence set again on 0.19.2, put in a folder of its own by
`scripts/install_megatron_core.py` and first on PYTHONPATH. These tests cross the two:

  checkpoints    `dhelix train --dhelix` (TP=2+SP, cosine schedule) 4 steps saving every 2
                 on each release, then each one's iteration-2 save alone resumed on the
                 OTHER release: steps 3 and 4 (losses, learning rates, every step's
                 gradient checksums) and the final weights equal the resuming release's
                 straight run bit for bit. The two straight runs are equal too: the same
                 math on both releases. (0.16 keeps a save's common state in common.pt,
                 0.19 inside the torch_dist files; the seam reads both on 0.16.)
  own warnings   a `dhelix train --dhelix` run on this release prints no deprecation
                 notice that DHelix's spec causes (0.19: a dense MLP given as a ModuleSpec
                 is rewrapped with a warning on every layer).

The 0.19.2 folder: $MCORE_0_19, else `.mcore-0.19.2` in the repository root. Without it
the crossing test skips naming the script (fails under CI=true, where .ci/run installs it).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from compare import same_numbers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW = "0.19.2"
FLAGS = ["--config", "tiny", "--nproc", "2", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", "--dhelix", "--lr-decay-style", "cosine",
         "--lr-warmup-iters", "1", "--checksums", "--timeout", "300"]


def _new_dir() -> str:
    d = os.environ.get("MCORE_0_19") or os.path.join(ROOT, f".mcore-{NEW}")
    if not os.path.exists(os.path.join(d, ".installed")):
        msg = (f"no megatron-core {NEW} at {d}: python scripts/install_megatron_core.py "
               f"{NEW} (or set MCORE_0_19)")
        if os.environ.get("CI") == "true":
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return os.path.abspath(d)


def _env(new_dir, version):
    """This environment with megatron-core `version`: the 0.19.2 folder first on
    PYTHONPATH, or taken off it for the pip-installed 0.16.1. DHELIX_EXPECT_MCORE makes
    every rank check which one it imported."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and os.path.abspath(p) != new_dir]
    if version == NEW:
        paths.insert(0, new_dir)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), DHELIX_EXPECT_MCORE=version)


def _train(env, out, *extra):
    r = subprocess.run([sys.executable, "-m", "dhelix.cli", "train", *FLAGS, "--json", out,
                        *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    with open(out) as f:
        return json.load(f), r.stdout + r.stderr


def _cut(root, cut, iteration=2):
    """The save of `iteration` alone under a new root (a run killed after it)."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(root, name), os.path.join(cut, name))
    with open(os.path.join(cut, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def _same_steps(resumed, straight, what):
    assert resumed["first_iteration"] == 3, what
    same_numbers(resumed["losses"], straight["losses"][2:], 0.0, f"{what}: losses")
    same_numbers(resumed["learning_rates"], straight["learning_rates"][2:], 0.0,
                 f"{what}: learning rates")
    assert resumed["grad_checksums"] == straight["grad_checksums"][2:], \
        f"{what}: gradient checksums of steps 3, 4"
    assert resumed["weight_checksums"] == straight["weight_checksums"], \
        f"{what}: final weights"


@pytest.mark.timeout(900)
def test_checkpoint_crosses_versions(tmp_path):
    new_dir = _new_dir()
    old_env, new_env = _env(new_dir, "0.16.1"), _env(new_dir, NEW)
    t = str(tmp_path)
    old, _ = _train(old_env, f"{t}/old.json", "--train-iters", "4", "--save", f"{t}/old",
                    "--save-interval", "2")
    new, _ = _train(new_env, f"{t}/new.json", "--train-iters", "4", "--save", f"{t}/new",
                    "--save-interval", "2")
    assert len(old["losses"]) == len(new["losses"]) == 4
    same_numbers(new["losses"], old["losses"], 0.0, "0.19.2 vs 0.16.1 losses")
    assert new["grad_checksums"] == old["grad_checksums"], "0.19.2 vs 0.16.1 gradients"
    assert new["weight_checksums"] == old["weight_checksums"], "0.19.2 vs 0.16.1 weights"
    assert not os.path.exists(f"{t}/new/iter_0000002/common.pt"), "0.19's save format"
    assert os.path.exists(f"{t}/old/iter_0000002/common.pt"), "0.16's save format"

    _cut(f"{t}/old", f"{t}/old-cut")
    _cut(f"{t}/new", f"{t}/new-cut")
    on_new, log = _train(new_env, f"{t}/on-new.json", "--train-iters", "4", "--load",
                         f"{t}/old-cut")
    assert f"resumed from {t}/old-cut/iter_0000002: iteration 2" in log, log[-2000:]
    _same_steps(on_new, new, "a 0.16.1 save resumed on 0.19.2")
    on_old, log = _train(old_env, f"{t}/on-old.json", "--train-iters", "4", "--load",
                         f"{t}/new-cut")
    assert f"resumed from {t}/new-cut/iter_0000002: iteration 2" in log, log[-2000:]
    _same_steps(on_old, old, "a 0.19.2 save resumed on 0.16.1")


def test_no_deprecation_notice_from_dhelix_spec(tmp_path):
    """On the release this suite runs on (both, under .ci/run): a 2-step run with DHelix's
    spec prints none of megatron's notices about the MLP spec's form."""
    from dhelix.compat import mcore
    _, log = _train(dict(os.environ), str(tmp_path / "r.json"), "--train-iters", "2")
    assert "Rewrapping ModuleSpec" not in log and "as_mlp_submodule" not in log, \
        f"megatron-core {mcore.version_string()}: {log[-3000:]}"
