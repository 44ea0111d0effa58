"""jitllmd: an LLM inference toolkit whose model blocks live on devices or in a host pager."""

__version__ = "0.1.0"
