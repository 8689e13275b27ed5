"""DHelix: strand interleaving for megatron-core (see README.md)."""
__version__ = "0.1.0"        # as setup.py
