"""All-reduce benchmark (ring / tree / hierarchical vs native); see fedagg.collectives.bench.

Usage: python benchmarks/allreduce.py --world-sizes 2,4 --sizes 4KB,1MB,16MB --markdown
"""

import sys

from fedagg.collectives.bench import main

if __name__ == "__main__":
    sys.exit(main())
