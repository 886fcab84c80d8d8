"""ladder: an LLM inference serving stack. The `ladder` command lives in `ladder.cli`."""

__version__ = "0.1.0"
