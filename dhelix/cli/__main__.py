"""`python -m dhelix.cli ...`: how the launcher, srun and the tests start ranks."""
import atexit
import os
import sys

from dhelix.cli import main


def _exit(rc: int) -> None:
    """Exit without the interpreter's finalization once the work is done: torch's and
    gloo's C++ threads can be destroyed while joinable there ("terminate called without
    an active exception", SIGABRT) after every output was written. The atexit handlers
    (shared-memory segments' unlink) still run; files are closed by their `with`s."""
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


_exit(main() or 0)
