"""A free TCP port on 127.0.0.1: the product's own helper (`sloserve bench compare`, `make demo`)."""

from sloserve.bench.local_server import free_port

__all__ = ["free_port"]
