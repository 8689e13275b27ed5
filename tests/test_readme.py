"""docs/testing.md's "What is tested where" against the tests: the counts and tolerances it
quotes are the constants the tests use, and every test file is listed there."""
import os

import test_context_parallel
import test_folding
import test_links
import test_moe
import test_schedule
import test_strand

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _section() -> str:
    text = open(os.path.join(ROOT, "docs", "testing.md")).read()
    start = text.index("## What is tested where")
    end = text.index("**On a lent GPU.**", start)
    return " ".join(text[start:end].split())          # one line, single spaces


def _row(section: str, area: str) -> str:
    start = section.index(f"| {area} |")
    return section[start:section.index(" | ", start + len(area) + 4)]


def _e(x: float) -> str:            # 1e-05 -> "1e-5", as docs/testing.md writes it
    return f"{x:.0e}".replace("e-0", "e-")


CLAIMS = [
    ("strand layer", lambda: f"earliest-wgrad plans and {test_strand.RANDOM_PLANS} random "
                             f"legal plans"),
    ("strand layer", lambda: "SwiGLU/GQA at TP=1" if test_strand.RANDOM_PLANS_TP1 ==
     test_strand.RANDOM_PLANS else f"TP=1 with {test_strand.RANDOM_PLANS_TP1}"),
    ("schedule", lambda: f"{test_schedule.MANY_STEPS} steps for each of "
                         f"{test_schedule.MANY_PLANS_TP2_SP} distinct random legal plans"),
    ("schedule", lambda: f"and {test_schedule.MANY_PLANS_TP2_DP2} (tiny TP=2+SP × DP=2"),
    ("schedule", lambda: f"{test_schedule.STEPS} steps with the built-in paired plan"),
    ("context parallel", lambda: f"trivial, paired and {test_context_parallel.LAYER_PLANS} "
                                 f"random legal plans per layout"),
    ("context parallel", lambda: f"{test_context_parallel.STEPS} steps CP=2 ≡ CP=1"),
    ("moe", lambda: f"trivial, paired and {test_moe.MOE_PLANS} random legal plans"),
    ("folding", lambda: f"every TP position, ≤{_e(test_folding.FOLD_TOL)}"),
    ("folding", lambda: f"the final weights' ≤{_e(test_folding.FOLD_WEIGHT_TOL)}"),
    ("folding", lambda: f"{test_folding.STEPS} steps at PP=2"),
    ("links", lambda: f"between 0.99× and {test_links.SLACK:g}× + "
                      f"{test_links.SLACK_S * 1000:g} ms of the modelled time"),
]


def test_quoted_numbers_are_the_tests_constants():
    section = _section()
    wrong = [(area, claim()) for area, claim in CLAIMS if claim() not in _row(section, area)]
    assert not wrong, "docs/testing.md's test section disagrees with the tests: " + "; ".join(
        f"row '{a}' should say '{c}'" for a, c in wrong)


def test_every_test_file_is_listed_and_every_listed_file_exists():
    section = _section()
    files = sorted(f for f in os.listdir(os.path.join(ROOT, "tests"))
                   if f.startswith("test_") and f.endswith(".py"))
    unlisted = [f for f in files if f"`{f}`" not in section and f"{f}`" not in section]
    assert not unlisted, f"test files docs/testing.md's test section does not name: {unlisted}"
    import re
    named = set(re.findall(r"`?(test_[a-z_]+\.py)`", section))
    assert not named - set(files), f"named but missing: {sorted(named - set(files))}"
