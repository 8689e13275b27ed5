"""Megatron-LM integration: `--dhelix*` arguments, the layer spec, the install hook."""
