"""`sloserve.serve` on a checkpoint, with faults injected by request id (for the fault tests).

Usage: python -m tests.reliability.fault_server MODEL_DIR

The product has no fault-injection hook yet, so this process monkeypatches three places before
serving (client ids reach the engine as '<stream prefix>:<client id>'):
  * a client id starting 'poison-fwd'  -> ModelRunner.execute raises whenever that sequence is in
    the batch (a forward that fails for one request);
  * a client id starting 'poison-post' -> the scheduler's per-token post-processing raises for it;
  * a client id starting 'kill-loop'   -> Scheduler.schedule raises (the engine loop itself dies).
"""

from __future__ import annotations

import sys

from sloserve import serve
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig, SloserveConfig
from sloserve.engine import scheduler as scheduler_module
from sloserve.executor.runner import ModelRunner


def _client_id(engine_id: str) -> str:
    return engine_id.split(":", 1)[-1]


def install_faults() -> None:
    execute = ModelRunner.execute

    def faulty_execute(self, out):
        for seq in out.sequences:
            if _client_id(seq.req_id).startswith("poison-fwd"):
                raise RuntimeError(f"injected forward failure for {_client_id(seq.req_id)}")
        return execute(self, out)

    process_token = scheduler_module.process_token

    def faulty_process_token(req, token, eos_token_ids, max_model_len):
        if _client_id(req.request_id).startswith("poison-post"):
            raise ValueError(f"injected post-processing failure for {_client_id(req.request_id)}")
        return process_token(req, token, eos_token_ids, max_model_len)

    schedule = scheduler_module.Scheduler.schedule

    def faulty_schedule(self):
        if any(_client_id(rid).startswith("kill-loop") for rid in self.requests):
            raise SystemError("injected engine loop failure")
        return schedule(self)

    ModelRunner.execute = faulty_execute
    scheduler_module.process_token = faulty_process_token
    scheduler_module.Scheduler.schedule = faulty_schedule


def main(model: str) -> int:
    install_faults()
    config = SloserveConfig(
        model=ModelConfig(path=model, device="cpu", max_model_len=256),
        cache=CacheConfig(kv_pool_bytes=256 * 8192),
        scheduler=SchedulerConfig(max_batch=16),
        server=ServerConfig(port=0, metrics_port=None, log_format="json", grace_s=5.0))
    return serve.main(config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
