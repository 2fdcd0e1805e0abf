"""nano-vllm's throughput benchmark for jaxllm: `python scripts/bench.py [--tp 2] [--json PATH]`.

See `jaxllm/research/bench.py` for the workload and the flags.
"""

import sys

from jaxllm.research.bench import main

if __name__ == "__main__":
    sys.exit(main())
