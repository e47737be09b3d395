"""``python -m deepspeed_acco.bench.network.latency``: the latency model's command line (:mod:`.report`)."""
import sys

from .report import main

if __name__ == "__main__":
    sys.exit(main())
