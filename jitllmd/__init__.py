"""jitllmd: an LLM inference toolkit whose model blocks live on devices or in a host pager."""

import os as _os

# torch's OpenMP threads (libgomp, which reads this once, as torch loads it) spin ~300,000 rounds waiting for the
# next parallel region. Between torch's ops the engine runs its own kernels on its own thread pool, and on a machine
# with few cores those spinning threads take the cores the pool's threads need: a quantized prompt ran ~1.5x slower
# and a bf16 decode step ~1.6x slower (2-core Xeon). A short spin keeps torch's back-to-back ops quick and gives the
# cores up soon after. Set before importing torch; a value the user set stays.
_os.environ.setdefault("GOMP_SPINCOUNT", "3000")

__version__ = "0.1.0"
