"""`sloserve serve --node-rank K` (K > 0): run node K's tensor-parallel ranks, serve nothing else.

Node 0 runs the engine (rank 0) and its own local ranks; every other node only starts its ranks,
which meet node 0 at --master-addr:--master-port and take commands from rank 0. This process
waits for them: it exits 0 when rank 0 stops them, non-zero when one fails, and stops them on
SIGINT/SIGTERM.
"""

from __future__ import annotations

import logging
import signal

from sloserve.config import SloserveConfig
from sloserve.models.loader import resolve_model_path
from sloserve.models.shard import check_divisible
from sloserve.models.spec import load_spec
from sloserve.parallel.runner import JOIN_TIMEOUT_S
from sloserve.parallel.worker import launch

log = logging.getLogger(__name__)


def node_ranks(config: SloserveConfig) -> range:
    pc = config.parallel
    first = pc.node_rank * pc.ranks_per_node
    return range(first, first + pc.ranks_per_node)


def serve_node(config: SloserveConfig) -> int:
    """Start this node's ranks and wait for them; the exit code of the first that failed, else 0."""
    pc = config.parallel
    check_divisible(load_spec(resolve_model_path(config.model.path)), pc.tensor_parallel_size)
    workers = launch(
        config,
        node_ranks(config),
        pc.master_addr,
        pc.master_port,
        JOIN_TIMEOUT_S,
        logging.getLogger().level,
    )

    def stop(signum: int, _frame: object) -> None:
        log.info("node %d: %s, stopping its ranks", pc.node_rank, signal.Signals(signum).name)
        for proc in workers:
            proc.kill()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    codes = [proc.wait() for proc in workers]
    failed = [c for c in codes if c != 0]
    return failed[0] if failed else 0
