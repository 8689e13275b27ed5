"""Emulated cluster links for local ranks on one machine (DESIGN §4), chosen by `--link`:

    none            the unlimited loopback
    RATE            `tbf.py`: a network namespace whose loopback `tc tbf` limits to RATE
                    (e.g. 2gbit). Every byte is CPU work on the cores that also compute:
                    the harsh second opinion.
    paced:RATE[,LAT] `paced.py`: ranks talk over the unlimited loopback, and every
                    collective on a non-default group completes no earlier than a link
                    model says (a FIFO link per group, ring bytes, RATE, LAT per hop),
                    waiting without holding a core — a NIC or NVLink moving bytes by DMA.
"""
from __future__ import annotations

import contextlib
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


def parse_link(text: str, flag: str = "--link") -> Link:
    text = (text or "none").strip()
    if text == "none":
        return Link("none", text)
    if text.startswith("paced:"):
        parts = text[len("paced:"):].split(",")
        if len(parts) > 2 or not parts[0]:
            raise LinkError(f"{flag}: {text!r}: use paced:RATE or paced:RATE,LATENCY "
                            f"(e.g. paced:2gbit,20us)")
        lat = parse_seconds(parts[1], flag) if len(parts) == 2 else DEFAULT_PACED_LATENCY_S
        return Link("paced", text, parse_rate(parts[0], flag), lat)
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
