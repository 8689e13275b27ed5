"""The tbf link: a network namespace whose loopback is rate-limited, as a context manager.

Local gloo ranks started inside it talk over a link of the given rate, like a cluster
whose links are slow relative to its compute. Needs root and iproute2; the namespace is
deleted on exit, also when the body raises.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from typing import List, Optional


class NetnsError(RuntimeError):
    pass


def _run(cmd: List[str]):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class SlowLink:
    """`with SlowLink("4gbit") as prefix:` — run commands as prefix + argv."""

    def __init__(self, rate: Optional[str], delay: Optional[str] = None):
        self.rate, self.delay = rate, delay
        self.name = f"dhelix-{uuid.uuid4().hex[:8]}"
        self.prefix: List[str] = []

    def __enter__(self) -> List[str]:
        if not self.rate or self.rate == "none":
            return []
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            raise NetnsError("a slowed link needs root and iproute2 (ip, tc); run without "
                             "--link or as root")
        _run(["ip", "netns", "add", self.name])
        try:
            # A real link has no free burst: keep the token bucket small, so that every
            # message (hundreds of KiB) is paced at the rate. The bucket must still
            # hold one packet, hence a 9000-byte MTU instead of loopback's 64 KiB.
            _run(["ip", "-n", self.name, "link", "set", "lo", "mtu", "9000"])
            _run(["ip", "-n", self.name, "link", "set", "lo", "up"])
            tc = ["ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo"]
            tbf = ["tbf", "rate", self.rate, "burst", "32kb", "latency", "400ms"]
            if self.delay:
                _run(tc + ["root", "handle", "1:", "netem", "delay", self.delay])
                _run(tc + ["parent", "1:", "handle", "2:"] + tbf)
            else:
                _run(tc + ["root"] + tbf)
        except Exception:
            self.__exit__()
            raise
        self.prefix = ["ip", "netns", "exec", self.name]
        return self.prefix

    def __exit__(self, *exc):
        if self.rate and self.rate != "none":
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        return False
