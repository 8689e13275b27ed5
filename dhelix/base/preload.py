"""Imported once by the fork server that starts local ranks (`dhelix.testing.run_ranks`):
the slow imports every rank needs, done before the fork so that each rank skips them.
Third-party modules only, and DHelix's warning filter (which reads nothing): DHelix's
other modules read the environment when imported, and a rank's environment is set after
the fork."""
from dhelix.base.warnings import quiet_library_warnings

quiet_library_warnings()
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

try:
    import megatron.core  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
except ImportError:   # ranks that do not need megatron-core still start
    pass
