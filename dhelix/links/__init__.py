"""Emulated cluster links for local ranks on one machine (DESIGN §4), chosen by `--link`:

    none            the unlimited loopback
    RATE            `tbf.py`: a network namespace whose loopback `tc tbf` limits to RATE
                    (e.g. 2gbit). Every byte is CPU work on the cores that also compute:
                    the harsh second opinion.
    paced:RATE[,LAT][,slow=X]
                    `paced.py`: ranks talk over the unlimited loopback, and every
                    collective on a non-default group completes no earlier than a link
                    model says (a FIFO link per group, ring bytes, RATE, LAT per hop,
                    default 20us), waiting without holding a core — a NIC or NVLink
                    moving bytes by DMA. `slow=X` (0 <= X <= 4, default 0) charges for
                    the overlap (`contention.py`): a GEMM that runs while a transfer of
                    its rank is in flight is stretched by X times the in-flight part of
                    its time, as a NCCL kernel's SMs slow the GEMMs it overlaps.

    RATE is a number with [k|m|g]bit (bits/s) or [k|m|g]bps (bytes/s), LAT a
    number with us/ms/s; the parts of a paced link come in this order, separated by
    commas, e.g. `paced:1gbit`, `paced:1gbit,20us`, `paced:1gbit,slow=0.15`,
    `paced:1gbit,20us,slow=0.15`.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple


class LinkError(ValueError):
    """A `--link` value that cannot be read; the message names the flag and the fix."""


@dataclass(frozen=True)
class Link:
    kind: str                 # "none" | "tbf" | "paced"
    text: str                 # as given on the command line
    rate_Bps: float = 0.0     # bytes/s per direction per rank
    latency_s: float = 0.0    # per ring hop (paced)
    slow: float = 0.0         # share GEMMs are stretched by while a transfer is in flight


def parse_rate(rate: str, flag: str = "--link") -> float:
    """'2gbit' -> bytes/s (2e9 / 8); '100mbps' -> 1e8 bytes/s."""
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise LinkError(f"{flag}: cannot read rate {rate!r} (use e.g. 2gbit, 500mbit)")
    v = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    if v <= 0:
        raise LinkError(f"{flag}: rate {rate!r} must be positive")
    return v / 8 if m.group(3) == "bit" else v


def parse_seconds(t: str, flag: str = "--link") -> float:
    """'50us' / '1ms' / '0.2s' -> seconds."""
    m = re.fullmatch(r"([\d.]+)\s*(us|ms|s)", t.strip().lower())
    if not m:
        raise LinkError(f"{flag}: cannot read latency {t!r} (use e.g. 20us, 1ms)")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


DEFAULT_PACED_LATENCY_S = 20e-6
MAX_SLOW = 4.0
PACED_FORMS = "paced:RATE[,LATENCY][,slow=X] (e.g. paced:2gbit,20us,slow=0.15)"


def parse_slow(value: str, flag: str = "--link") -> float:
    """'0.15' -> 0.15: the share a GEMM is stretched by while a transfer is in flight."""
    fix = (f"give a number from 0 to {MAX_SLOW:g}, the share by which a GEMM that overlaps "
           f"a transfer is slowed (e.g. slow=0.15 for 15%; 0 turns contention off)")
    try:
        v = float(value)
    except ValueError:
        raise LinkError(f"{flag}: cannot read slow={value!r}: {fix}") from None
    if not math.isfinite(v) or not 0.0 <= v <= MAX_SLOW:
        raise LinkError(f"{flag}: slow={value!r} is out of range: {fix}")
    return v


def _parse_paced(text: str, flag: str) -> Link:
    parts = [p.strip() for p in text[len("paced:"):].split(",")]
    if not parts[0] or "=" in parts[0]:
        raise LinkError(f"{flag}: {text!r}: use {PACED_FORMS}")
    rate = parse_rate(parts[0], flag)
    lat, opts = DEFAULT_PACED_LATENCY_S, {}
    for i, part in enumerate(parts[1:], start=1):
        if "=" not in part:
            if i != 1:
                raise LinkError(f"{flag}: {text!r}: use {PACED_FORMS}; the latency comes "
                                f"right after the rate, once")
            lat = parse_seconds(part, flag)
            continue
        key, value = (s.strip() for s in part.split("=", 1))
        if key != "slow":
            raise LinkError(f"{flag}: {text!r}: unknown option {key!r}: the paced link "
                            f"takes slow=X only ({PACED_FORMS})")
        if key in opts:
            raise LinkError(f"{flag}: {text!r}: {key}= given twice; give it once")
        opts[key] = parse_slow(value, flag)
    return Link("paced", text, rate, lat, opts.get("slow", 0.0))


def parse_link(text: str, flag: str = "--link") -> Link:
    text = (text or "none").strip()
    if text == "none":
        return Link("none", text)
    if text.startswith("paced:"):
        return _parse_paced(text, flag)
    if "=" in text:
        raise LinkError(f"{flag}: {text!r}: options such as slow=X are for the paced link "
                        f"only: use {PACED_FORMS}")
    return Link("tbf", text, parse_rate(text, flag))


@contextlib.contextmanager
def launch(link: Link) -> Iterator[Tuple[List[str], Dict[str, str]]]:
    """(command prefix, environment) for ranks started on `link`; the namespace of a
    tbf link lives as long as the context."""
    env = {"DHELIX_LINK": link.text}
    if link.kind != "tbf":
        yield [], env
        return
    from dhelix.links.tbf import SlowLink
    with SlowLink(link.text) as prefix:
        # a namespace has no hostname entry: c10d would warn on every rank
        yield prefix, dict(env, TORCH_CPP_LOG_LEVEL="ERROR")
