"""A benchmark server built from the typed config (so a benchmark does not depend on CLI flags):
python -m benchmarks._launch MODE MODEL PORT OVERRIDES_JSON (see harness.launch)."""

import json
import sys

if __name__ == "__main__":  # NOTE: not when the engine process (spawned) imports this module again
    from sloserve.openmp import default_waiting

    default_waiting()  # as the sloserve command does, before torch loads
    from sloserve.serve import main

    from benchmarks.harness import launch_config

    sys.exit(
        main(launch_config(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])))
    )
