"""The baseline: megatron-core's own forward-backward function and layer."""
from __future__ import annotations


class MegatronSchedule:
    name = "megatron"
    layer_module = None          # megatron's TransformerLayer

    def prepare(self, model, tconfig):
        pass

    def check(self, model, seq_length, micro_batch_size):
        pass

    def forward_backward(self, **kw):
        from megatron.core.pipeline_parallel import get_forward_backward_func
        return get_forward_backward_func()(**kw)

    def finish(self, rank: int = 0):
        return None
