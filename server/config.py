"""The one typed configuration, built by the CLI (or the offline API) and validated once.

Components copy the few fields they need at construction; no module reads the environment.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from sloserve.hotpath import MAX_EXPERT_ENTRIES, MAX_QUEUE_CAPACITY

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "KI": 1024,
    "MI": 1024**2,
    "GI": 1024**3,
    "TI": 1024**4,
}


def parse_size(text: str | int) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, 1024 -> 1024; ValueError says the accepted forms."""
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"size must be > 0 bytes, got {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(
            f"cannot read size {text!r}: use a number of bytes or e.g. 512MiB, 2GiB, 1.5GB"
        )
    unit = (match.group(2) or "").upper().removesuffix("B")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be > 0 bytes, got {text!r}")
    return value


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(slots=True)
class ModelConfig:
    path: str = "default"  # a local Hugging Face folder, or 'default' / 'default-moe'
    device: str = "auto"  # 'auto' (cuda if available), 'cpu', 'cuda', 'cuda:N'
    dtype: str = (
        "auto"  # 'auto' (float32 on CPU, bfloat16 on GPU), 'float32', 'bfloat16', 'float16'
    )
    attention_backend: str = "auto"  # 'auto', 'reference', 'sdpa', 'flash', 'triton'
    max_model_len: int | None = None  # defaults to the checkpoint's max_position_embeddings
    # True: run the decode step eagerly; False: torch.compile it (batch buckets, warmed at start-up);
    # None: the device's default, eager on a CPU (compiling costs ~30 s per shape there and pays
    # only at small batches; see executor/compiled.py)
    enforce_eager: bool | None = None
    # Dense projections of a float32 model on a CPU: 'auto'/'onednn' pack the weights for oneDNN
    # (AVX-512 where MKL runs AVX2; the projections are then held twice), 'blas' keeps torch's
    # F.linear (see layers/linear.py). 'onednn' is an error where it cannot run; 'auto' falls back.
    cpu_gemm: str = "auto"
    # Host memory on a CPU: 'keep' raises glibc's mmap and trim thresholds so a step's activations
    # reuse heap pages instead of faulting fresh ones in (executor/host_memory.py); RSS then stays
    # at its peak. 'system' leaves malloc as it is.
    host_malloc: str = "keep"
    grammar_cache: int = (
        64  # structured output: compiled grammars kept per engine (LRU), one per distinct spec
    )

    def __post_init__(self) -> None:
        _require(self.grammar_cache >= 1, f"grammar cache must be >= 1, got {self.grammar_cache}")
        _require(
            self.host_malloc in ("keep", "system"),
            f"host malloc must be keep or system, got {self.host_malloc!r}",
        )
        _require(
            self.cpu_gemm in ("auto", "onednn", "blas"),
            f"cpu gemm must be auto, onednn or blas, got {self.cpu_gemm!r}",
        )
        _require(
            bool(self.path), "model path must not be empty (use 'default' for the built-in model)"
        )
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}",
        )
        _require(
            self.attention_backend in ("auto", "reference", "sdpa", "flash", "triton"),
            f"attention backend must be auto, reference, sdpa, flash or triton, got {self.attention_backend!r}",
        )
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len must be > 0")


@dataclass(slots=True)
class CacheConfig:
    block_size: int | None = (
        None  # tokens per KV page; None: the attention backend's (flash 256, else 16)
    )
    kv_pool_bytes: int | None = None  # None: a default that suits the device (see memory.pool)
    gpu_memory_fraction: float = 0.85  # used on a GPU when kv_pool_bytes is None
    arena_bytes: int | None = None  # None: 256 MiB on GPU, 16 MiB on CPU
    swap_bytes: int = 256 * 1024**2  # host pool for swap preemption (pinned on CUDA)
    prefix_cache: bool = True
    # MoE expert residency (see executor/residency.py). At most one of the two explicit settings:
    expert_slots_per_layer: int | None = (
        None  # routed experts resident per MoE layer; None: automatic
    )
    expert_memory_bytes: int | None = (
        None  # device bytes for expert slots (-> slots per layer); None: automatic
    )
    # Device bytes for experts + KV pool + workspaces (dense weights not included). None: on a GPU,
    # gpu_memory_fraction of the memory free after the dense weights; on a CPU, no limit. When all
    # experts plus the minimum KV pool do not fit, only some experts per layer stay resident.
    memory_budget_bytes: int | None = None
    expert_preload: bool = (
        True  # partial residency: pin the most routed experts, prefetch predicted ones
    )

    def __post_init__(self) -> None:
        bs = self.block_size
        _require(
            bs is None or (bs > 0 and bs & (bs - 1) == 0),
            f"block_size must be a power of two, got {bs}",
        )
        _require(
            self.kv_pool_bytes is None or self.kv_pool_bytes > 0, "kv pool size must be > 0 bytes"
        )
        _require(0.0 < self.gpu_memory_fraction <= 1.0, "gpu memory fraction must be in (0, 1]")
        _require(self.swap_bytes >= 0, "swap space must be >= 0 bytes")
        slots = self.expert_slots_per_layer
        _require(
            slots is None or slots <= MAX_EXPERT_ENTRIES,
            f"expert slots per layer must be <= {MAX_EXPERT_ENTRIES}, got {slots}",
        )
        _require(slots is None or slots >= 1, f"expert slots per layer must be >= 1, got {slots}")
        _require(
            self.expert_memory_bytes is None or self.expert_memory_bytes > 0,
            "expert memory must be > 0 bytes",
        )
        _require(
            slots is None or self.expert_memory_bytes is None,
            "expert slots per layer and expert memory both set residency: give only one",
        )
        _require(
            self.memory_budget_bytes is None or self.memory_budget_bytes > 0,
            "memory budget must be > 0 bytes",
        )


POLICIES = ("slo", "priority", "fifo")
MAX_SCHEDULER_STEPS = 64  # a longer run would hold a newcomer back for too many steps
DEFAULT_SCHEDULER_STEPS = 8  # 8 beat 4 on TPOT at concurrency 1 (docs/design/cpu-decode.md)


@dataclass(slots=True)
class SchedulerConfig:
    policy: str = "slo"  # 'slo' (deadlines), 'priority' (integer priority, then arrival) or 'fifo'
    # slo policy only: compose each step from deadlines (who decodes, how big a prefill chunk)
    # and preempt the running request with the most slack; off = urgency order, least urgent victim
    deadline_steps: bool = True
    slack_preemption: bool = True
    # slo policy: aim each end-to-end deadline this share of its objective early (what the client
    # counts beyond the engine's clock: the trip in, the last token's way out, a late step's jitter)
    finish_margin: float = 0.05
    max_batch: int = 64  # most requests running at once
    max_batched_tokens: int = 2048  # token budget of one step
    chunked_prefill: bool = True
    prefill_chunk: int = (
        512  # longest prefill chunk of one request in a step others share (alone: the budget)
    )
    preemption_mode: str = "swap"  # 'swap' (falls back to recompute) or 'recompute'
    batch_decay: float = 0.9  # adaptive batch target: ceil(max_batch * (1 - decay ** depth))
    adaptive_batch: bool = (
        False  # off by default: with max_batch 64 the target is >= the queue depth (caps nothing)
    )
    aging: float = 0.95  # key multiplier per step waited
    max_wait_s: float = (
        2.0  # starvation bound; the write-up's 200 ms cost goodput (docs/scheduling.md)
    )
    length_weight_s: float = 1e-4  # seconds of urgency per prompt token
    default_ttft_s: float = 2.0  # first-token objective when a request gives none
    max_waiting: int = 1024  # admission: queue cap
    queue_timeout_s: float = 30.0  # admission: longest wait before refusal
    admission_control: bool = True  # refuse requests whose SLO cannot be met
    # Decode steps run back to back per schedule when every running request decodes and none
    # waits (Scheduler._run_length): the scheduler, output and IPC work is paid once per run.
    num_scheduler_steps: int = DEFAULT_SCHEDULER_STEPS

    def __post_init__(self) -> None:
        _require(
            self.policy in POLICIES,
            f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}",
        )
        _require(
            0.0 <= self.finish_margin < 1.0,
            f"finish margin must be in [0, 1), got {self.finish_margin}",
        )
        _require(self.max_batch >= 1, f"max batch must be >= 1, got {self.max_batch}")
        _require(
            1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS,
            f"num scheduler steps must be in [1, {MAX_SCHEDULER_STEPS}], got {self.num_scheduler_steps}",
        )
        _require(self.max_batched_tokens >= 1, "max batched tokens must be >= 1")
        _require(self.prefill_chunk >= 1, "prefill chunk must be >= 1")
        _require(
            self.preemption_mode in ("swap", "recompute"),
            f"preemption mode must be 'swap' or 'recompute', got {self.preemption_mode!r}",
        )
        _require(
            0.0 < self.batch_decay < 1.0, f"batch decay must be in (0, 1), got {self.batch_decay}"
        )
        _require(0.0 < self.aging <= 1.0, f"aging must be in (0, 1], got {self.aging}")
        _require(
            math.isfinite(self.max_wait_s) and self.max_wait_s > 0, "max wait must be > 0 seconds"
        )
        _require(self.length_weight_s >= 0, "length weight must be >= 0")
        _require(self.max_waiting >= 1, "max waiting must be >= 1")
        _require(
            self.max_waiting <= MAX_QUEUE_CAPACITY,
            f"max waiting must be <= {MAX_QUEUE_CAPACITY} (the hot-path queue's limit), got {self.max_waiting}",
        )
        _require(self.queue_timeout_s > 0, "queue timeout must be > 0 seconds")


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = 9464  # None disables the Prometheus endpoint
    max_message_bytes: int = 16 * 1024**2
    max_prompt_tokens: int | None = None  # None: the model's context length
    max_tokens_limit: int = 4096
    max_logprobs: int = (
        20  # most top log-probabilities per token a request may ask for (OpenAI's limit)
    )
    max_n: int = 16  # most choices (n) one request may ask for
    # Stop strings: OpenAI takes 4, TGI 4 by default; 16 leaves room for a chat template's end
    # markers plus a client's own, and 256 characters for any delimiter. At the limit a
    # request's automaton has <= 4096 nodes.
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64  # stop_token_ids checked on every token: bounded like the strings
    max_prompts_per_request: int = 64  # most prompts in one completions request (a list of prompts)
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = (
        None  # PEM CA bundle: clients must present a certificate it signed (mTLS), on every port
    )
    metrics_host: str | None = None  # address the Prometheus port binds [default: host]
    metrics_token: str | None = None  # bearer token the Prometheus port requires (None: open)
    grace_s: float = 10.0
    log_format: str = "text"
    engine_process: bool = (
        True  # run EngineCore in a process of its own (False: a thread of this one)
    )
    idle_spin_s: float = (
        1.0  # engine process: keeps polling this long after its last step before it sleeps
    )
    frontends: int = (
        1  # front-end processes sharing the engine process and the ports (SO_REUSEPORT)
    )
    metrics_compat: str = (
        "none"  # 'vllm': also export the vllm:-named series gateways and dashboards read
    )
    served_model_name: str | None = (
        None  # the model_name label of every metric [default: the model path]
    )

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, f"port must be in 0..65535, got {self.port}")
        _require(
            self.metrics_port is None or 0 <= self.metrics_port < 65536,
            "metrics port must be in 0..65535",
        )
        _require(
            (self.tls_cert is None) == (self.tls_key is None),
            "TLS needs both --tls-cert and --tls-key",
        )
        _require(
            self.tls_ca is None or self.tls_cert is not None,
            "tls ca (client certificates) needs TLS on: give --tls-cert and --tls-key too",
        )
        _require(
            self.metrics_token is None or bool(self.metrics_token.strip()),
            "metrics token must not be empty",
        )
        _require(self.log_format in ("text", "json"), "log format must be 'text' or 'json'")
        _require(self.max_tokens_limit >= 1, "max tokens limit must be >= 1")
        _require(self.max_logprobs >= 0, f"max logprobs must be >= 0, got {self.max_logprobs}")
        _require(self.max_n >= 1, f"max n must be >= 1, got {self.max_n}")
        _require(
            self.max_stop_strings >= 0,
            f"max stop strings must be >= 0, got {self.max_stop_strings}",
        )
        _require(
            self.max_stop_string_chars >= 1,
            f"max stop string chars must be >= 1, got {self.max_stop_string_chars}",
        )
        _require(
            self.max_stop_token_ids >= 0,
            f"max stop token ids must be >= 0, got {self.max_stop_token_ids}",
        )
        _require(
            self.max_prompts_per_request >= 1,
            f"max prompts per request must be >= 1, got {self.max_prompts_per_request}",
        )
        _require(
            0 <= self.idle_spin_s <= 60,
            f"idle spin must be in 0..60 seconds, got {self.idle_spin_s}",
        )
        _require(1 <= self.frontends <= 64, f"frontends must be in 1..64, got {self.frontends}")
        _require(
            self.frontends == 1 or self.engine_process,
            "frontends > 1 needs the engine in a process of its own (drop --no-engine-process)",
        )
        _require(
            self.metrics_compat in ("none", "vllm"),
            f"metrics compat must be none or vllm, got {self.metrics_compat!r}",
        )


@dataclass(slots=True)
class GrpcConfig:
    """What one gRPC client may hold: streams, requests, queued output, idle time (docs/threat-model.md).

    Durations are seconds; 0 turns an idle or age limit off. An error starts with the field's name
    (the CLI puts its flag there).
    """

    max_request_id_length: int = 256  # characters of a request_id, printable ASCII only
    max_streams: int = 1024  # Stream calls open at once, server-wide
    max_streams_per_connection: int = 128  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS
    max_connections: int = 1024  # connections open at once; more are closed at accept
    max_requests_per_stream: int = 512  # requests live on one Stream
    stream_queue: int = 256  # messages waiting to go out on one Stream before it stops reading
    stream_stall_s: float = (
        30.0  # one write blocked this long (the client reads nothing) ends the Stream
    )
    stream_idle_s: float = 600.0  # a Stream with no live request and no message for this long ends
    max_connection_idle_s: float = 900.0  # a connection with no call for this long gets GOAWAY
    max_connection_age_s: float = 0.0  # a connection older than this gets GOAWAY (off by default)
    max_connection_age_grace_s: float = 300.0  # then its calls get this long to finish
    keepalive_time_s: float = 60.0  # ping an idle connection this often, to find dead peers
    keepalive_timeout_s: float = 20.0  # a ping unanswered this long closes the connection
    min_ping_interval_s: float = 10.0  # a client pinging more often without data is sent GOAWAY

    def __post_init__(self) -> None:
        for name in (
            "max_request_id_length",
            "max_streams",
            "max_streams_per_connection",
            "max_connections",
            "max_requests_per_stream",
            "stream_queue",
        ):
            value = getattr(self, name)
            _require(1 <= value <= 2**31 - 1, f"{name} must be in 1..2147483647, got {value}")
        for name in ("stream_stall_s", "keepalive_time_s", "keepalive_timeout_s"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value > 0, f"{name} must be > 0 seconds, got {value}")
        for name in (
            "stream_idle_s",
            "max_connection_idle_s",
            "max_connection_age_s",
            "max_connection_age_grace_s",
            "min_ping_interval_s",
        ):
            value = getattr(self, name)
            _require(
                math.isfinite(value) and value >= 0,
                f"{name} must be >= 0 seconds (0: off), got {value}",
            )

    def channel_options(self) -> list[tuple[str, int]]:
        """The grpc core server options these limits set (0 leaves an idle or age limit at grpc's: off)."""
        ms = {
            "grpc.max_connection_idle_ms": self.max_connection_idle_s,
            "grpc.max_connection_age_ms": self.max_connection_age_s,
            "grpc.max_connection_age_grace_ms": self.max_connection_age_grace_s,
            "grpc.keepalive_time_ms": self.keepalive_time_s,
            "grpc.keepalive_timeout_ms": self.keepalive_timeout_s,
            "grpc.http2.min_ping_interval_without_data_ms": self.min_ping_interval_s,
        }
        options = [
            (key, int(value * 1000))
            for key, value in ms.items()
            if value > 0 or key == "grpc.http2.min_ping_interval_without_data_ms"
        ]
        return [
            *options,
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.http2.max_ping_strikes", 2),
        ]


@dataclass(slots=True)
class ParallelConfig:
    """Tensor parallelism: one worker process per rank, ranks spread evenly over `nnodes` machines.

    The rendezvous follows torchrun's conventions: every node names node 0's address and port;
    node 0 runs rank 0 (the engine) and its local ranks, node k runs ranks k*per_node.. only.
    """

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node only)

    def __post_init__(self) -> None:
        _require(
            self.tensor_parallel_size >= 1,
            f"tensor parallel size must be >= 1, got {self.tensor_parallel_size}",
        )
        _require(self.nnodes >= 1, f"nnodes must be >= 1, got {self.nnodes}")
        _require(
            self.tensor_parallel_size % self.nnodes == 0,
            f"tensor parallel size {self.tensor_parallel_size} must be a multiple of nnodes {self.nnodes} "
            "(every node runs the same number of ranks)",
        )
        _require(
            0 <= self.node_rank < self.nnodes,
            f"node rank must be in 0..{self.nnodes - 1}, got {self.node_rank}",
        )
        _require(
            self.master_port is None or 0 < self.master_port < 65536,
            f"master port must be in 1..65535, got {self.master_port}",
        )
        _require(
            self.nnodes == 1 or self.master_port is not None,
            "master port must be given when tensor parallelism spans nodes (--master-port)",
        )

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


@dataclass(slots=True)
class SloserveConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    grpc: GrpcConfig = field(default_factory=GrpcConfig)

    @classmethod
    def naive(cls, **model_kw) -> SloserveConfig:
        """The write-up's 'before': fifo, one request at a time, no prefix cache, no chunking."""
        return cls(
            model=ModelConfig(**model_kw),
            cache=CacheConfig(prefix_cache=False),
            scheduler=SchedulerConfig(
                policy="fifo",
                max_batch=1,
                chunked_prefill=False,
                adaptive_batch=False,
                admission_control=False,
            ),
        )
