"""The one typed configuration, built by the CLI (or the offline API) and validated once.

Components copy the few fields they need at construction; no module reads the environment.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


def port_or_off(text: str) -> int | None:
    """'9464' -> 9464, 'off' -> None (a port flag that can be turned off)."""
    if text.lower() == "off":
        return None
    if not text.isdigit() or int(text) > 65535:
        raise ValueError(f"must be a port in 0..65535 or 'off', got {text!r}")
    return int(text)


class ConfigError(ValueError):
    """A field's value is refused; `field` names it, so the CLI can name the flag that sets it.

    A message that starts with "must" is said of the field itself: str() is "FIELD must ...", the
    CLI's "--FLAG must ..."; any other message is a sentence of its own ("--FLAG: message").
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}" if message.startswith("must") else message)
        self.field = field
        self.message = message


def require(ok: bool, field: str, message: str) -> None:
    """Raise ConfigError(field, message) unless `ok`."""
    if not ok:
        raise ConfigError(field, message)


@dataclass(frozen=True, slots=True)
class Flag:
    """The command-line flag of a config field (sloserve.cli.options makes its click option).

    name: "--max-batch"; a bool's off-switch is "--no-..." unless named ("--enforce-eager/--compile").
    parse: the flag is text that this turns into the field's value (a size, a port or 'off');
    shown: the default as help shows it, where that is not the field's default as text.
    """

    name: str
    help: str
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None
    shown: str | None = None
    aliases: tuple[str, ...] = ()
    envvar: str | None = None
    metavar: str | None = None


def flag(default: Any, name: str, help: str, **kw: Any) -> Any:
    """A field set by a command-line flag: the one place a knob, its flag and its help are written."""
    return field(default=default, metadata={"flag": Flag(name, help, **kw)})


_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
QUANTIZATIONS = ("none", "int8")
KV_CACHE_DTYPES = ("auto", "int8")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "reference", "sdpa", "flash", "triton")


@dataclass(slots=True)
class ModelConfig:
    path: str = flag(
        "default",
        "--model",
        "A Hugging Face checkpoint folder, or a built-in model: 'default' (3M Llama trained on "
        "ARC grids), 'default-random' / 'default-moe' (random weights).",
    )
    device: str = flag("auto", "--device", "auto, cpu, cuda or cuda:N.")
    dtype: str = flag(
        "auto",
        "--dtype",
        "Weights and KV dtype (auto: bfloat16 on GPU; on a CPU a bf16 checkpoint runs bfloat16 "
        "where the CPU has AVX512-BF16 or AMX-BF16 and a start-up probe finds it faster, "
        "everything else float32).",
        choices=DTYPES,
    )
    attention_backend: str = flag(
        "auto",
        "--attention-backend",
        "Attention kernel (auto picks the best available).",
        choices=ATTENTION_BACKENDS,
    )
    max_model_len: int | None = flag(
        None, "--max-model-len", "Context length [default: the checkpoint's]."
    )
    # NOTE: eager on a CPU by default: compiling costs ~30 s per shape there and pays only at
    # small batches (see executor/compiled.py)
    enforce_eager: bool | None = flag(
        None,
        "--enforce-eager/--compile",
        "Run the decode step eagerly, or compile it: on a GPU, decode steps are captured in "
        "CUDA graphs per batch bucket at start-up unless --enforce-eager; on a CPU, --compile "
        "torch.compiles them [default: graphs on a GPU, eager on a CPU].",
    )
    # NOTE: 'onednn' is an error where it cannot run; 'auto' falls back (see layers/linear.py)
    cpu_gemm: str = flag(
        "auto",
        "--cpu-gemm",
        "Dense projections of a float32 model on a CPU: oneDNN (auto uses it where torch has it; "
        "each weight is held once, packed or read in place), or torch's BLAS.",
        choices=("auto", "onednn", "blas"),
    )
    quantization: str = flag(
        "none",
        "--quantization",
        "Quantize at load (CPU only): int8 holds every weight matrix (the dense projections, "
        "the embedding and the LM head, a tied one once, and routed MoE experts) as int8 rows "
        "with a scale per row (products: weight-only at few rows, per-token int8 activations at "
        "more); norms and biases keep the model's dtype.",
        choices=QUANTIZATIONS,
    )
    # NOTE: 'keep' raises glibc's mmap and trim thresholds (executor/host_memory.py)
    host_malloc: str = flag(
        "keep",
        "--host-malloc",
        "On a CPU, keep freed activation memory in the heap (glibc thresholds raised: no page "
        "faults per step, RSS stays at its peak), or leave malloc as it is.",
        choices=("keep", "system"),
    )
    grammar_cache: int = flag(
        64,
        "--grammar-cache",
        "Structured output: compiled grammars the engine keeps (LRU), one per distinct "
        "schema, regex or grammar.",
    )

    def __post_init__(self) -> None:
        require(
            self.grammar_cache >= 1,
            "grammar_cache",
            f"grammar cache must be >= 1, got {self.grammar_cache}",
        )
        require(
            self.host_malloc in ("keep", "system"),
            "host_malloc",
            f"host malloc must be keep or system, got {self.host_malloc!r}",
        )
        require(
            self.cpu_gemm in ("auto", "onednn", "blas"),
            "cpu_gemm",
            f"cpu gemm must be auto, onednn or blas, got {self.cpu_gemm!r}",
        )
        require(
            self.quantization in QUANTIZATIONS,
            "quantization",
            f"quantization must be none or int8, got {self.quantization!r}",
        )
        require(
            bool(self.path),
            "path",
            "model path must not be empty (use 'default' for the built-in model)",
        )
        require(
            bool(_DEVICE_RE.match(self.device)),
            "device",
            f"must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )
        require(
            self.dtype in DTYPES,
            "dtype",
            f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}",
        )
        require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"attention backend must be auto, reference, sdpa, flash or triton, got {self.attention_backend!r}",
        )
        require(
            self.max_model_len is None or self.max_model_len > 0,
            "max_model_len",
            "max_model_len must be > 0",
        )


@dataclass(slots=True)
class CacheConfig:
    block_size: int | None = flag(
        None,
        "--block-size",
        "Tokens per KV page [default: what the attention backend wants: 256 for flash-attn, else 16].",
    )
    kv_pool_bytes: int | None = flag(
        None,
        "--kv-pool-size",
        "Bytes for the KV cache pool, e.g. 512MiB or 2GiB [default: suits the device].",
        parse=parse_size,
    )
    kv_cache_dtype: str = flag(
        "auto",
        "--kv-cache-dtype",
        "KV page dtype: auto (the model's dtype) or int8 (a CPU only: each token's K and V rows "
        "in int8 with a bf16 scale per KV head, ~3.9x the tokens of float32 pages).",
        choices=KV_CACHE_DTYPES,
    )
    gpu_memory_fraction: float = 0.85  # used on a GPU when kv_pool_bytes is None
    arena_bytes: int | None = None  # None: 256 MiB on GPU, 16 MiB on CPU
    swap_bytes: int = 256 * 1024**2  # host pool for swap preemption (pinned on CUDA)
    prefix_cache: bool = flag(
        True, "--prefix-cache", "Reuse the KV of prompt prefixes already computed."
    )
    # MoE expert residency (see executor/residency.py). At most one of the two explicit settings:
    expert_slots_per_layer: int | None = flag(
        None,
        "--expert-slots-per-layer",
        "MoE: routed experts per layer kept on the device (the rest in host memory, copied "
        "in when routed to) [default: all, or what --memory-budget allows].",
    )
    expert_memory_bytes: int | None = flag(
        None,
        "--expert-memory",
        "MoE: device bytes for resident experts, e.g. 8GiB (instead of --expert-slots-per-layer).",
        parse=parse_size,
    )
    # Dense weights not included; on a GPU the default is gpu_memory_fraction of what is free
    # after them.
    memory_budget_bytes: int | None = flag(
        None,
        "--memory-budget",
        "Device bytes for MoE experts + KV pool + workspaces, e.g. 40GiB [default: on a GPU "
        "the memory fraction of what is free after the dense weights; on a CPU no limit]. "
        "When all experts and the minimum KV pool do not fit, only some experts stay resident.",
        parse=parse_size,
    )
    expert_preload: bool = flag(
        True,
        "--expert-preload",
        "MoE with partial residency: pin the most routed experts and prefetch each layer's "
        "predicted experts (off: load experts only when routed to).",
    )

    def __post_init__(self) -> None:
        bs = self.block_size
        require(
            bs is None or (bs > 0 and bs & (bs - 1) == 0),
            "block_size",
            f"block_size must be a power of two, got {bs}",
        )
        require(
            self.kv_pool_bytes is None or self.kv_pool_bytes > 0,
            "kv_pool_bytes",
            "kv pool size must be > 0 bytes",
        )
        require(
            0.0 < self.gpu_memory_fraction <= 1.0,
            "gpu_memory_fraction",
            "gpu memory fraction must be in (0, 1]",
        )
        require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"kv_cache_dtype must be auto or int8, got {self.kv_cache_dtype!r} (auto stores KV "
            "pages in the model's dtype: pick that with --dtype)",
        )
        require(self.swap_bytes >= 0, "swap_bytes", "swap space must be >= 0 bytes")
        slots = self.expert_slots_per_layer
        require(
            slots is None or slots <= MAX_EXPERT_ENTRIES,
            "expert_slots_per_layer",
            f"expert slots per layer must be <= {MAX_EXPERT_ENTRIES}, got {slots}",
        )
        require(
            slots is None or slots >= 1,
            "expert_slots_per_layer",
            f"expert slots per layer must be >= 1, got {slots}",
        )
        require(
            self.expert_memory_bytes is None or self.expert_memory_bytes > 0,
            "expert_memory_bytes",
            "expert memory must be > 0 bytes",
        )
        require(
            slots is None or self.expert_memory_bytes is None,
            "expert_slots_per_layer",
            "expert slots per layer and expert memory both set residency: give only one",
        )
        require(
            self.memory_budget_bytes is None or self.memory_budget_bytes > 0,
            "memory_budget_bytes",
            "memory budget must be > 0 bytes",
        )


POLICIES = ("slo", "priority", "fifo")
MAX_SCHEDULER_STEPS = 64  # a longer run would hold a newcomer back for too many steps
DEFAULT_SCHEDULER_STEPS = 8  # 8 beat 4 on TPOT at concurrency 1 (docs/design/cpu-decode.md)
SPECULATION_MODES = ("off", "ngram", "auto")
PREFILL_ORDERS = ("arrival", "shortest")
MAX_SPECULATIVE_TOKENS = 64  # a verify step's rows: a prefill chunk's size at most


@dataclass(slots=True)
class SchedulerConfig:
    policy: str = flag(
        "slo",
        "--policy",
        "Who runs next: slo (steps composed from deadlines), priority (the request's "
        "integer priority, lower first, then arrival) or fifo (arrival order).",
        choices=POLICIES,
    )
    # Off: urgency order, and the least urgent request is the preemption victim.
    deadline_steps: bool = flag(
        True,
        "--deadline-steps",
        "slo policy: compose each step from deadlines (who decodes, how big a prefill chunk).",
    )
    slack_preemption: bool = flag(
        True,
        "--slack-preemption",
        "slo policy: preempt the running request with the most slack (off: the least urgent).",
    )
    # What the client counts beyond the engine's clock: the trip in, the last token's way out,
    # a late step's jitter.
    finish_margin: float = flag(
        0.05,
        "--finish-margin",
        "slo policy: aim each end-to-end deadline this share of its objective early.",
    )
    max_batch: int = flag(64, "--max-batch", "Most requests running at once.")
    max_batched_tokens: int = 2048  # token budget of one step
    chunked_prefill: bool = flag(
        True, "--chunked-prefill", "Split long prompts across steps so decodes keep flowing."
    )
    # longest prefill chunk of one request in a step others share (alone: the budget)
    prefill_chunk: int = 512
    # NOTE: shortest trades a burst's TTFT for its early finishers' TPOT (measurements:
    # docs/design/deadline-steps.md); it stays opt-in until the graceful-drain failure seen once
    # under it in CI (tests/cli/test_serve_process.py, sigterm) is understood
    prefill_order: str = flag(
        "arrival",
        "--prefill-order",
        "Prompts of equal slack: arrival (in arrival order, every prompt of the step advancing "
        "together) or shortest (least remaining prefill first, each finished before the next "
        "starts: earlier first tokens in a burst, more steps).",
        choices=PREFILL_ORDERS,
    )
    preemption_mode: str = "swap"  # 'swap' (falls back to recompute) or 'recompute'
    batch_decay: float = 0.9  # adaptive batch target: ceil(max_batch * (1 - decay ** depth))
    # off by default: with max_batch 64 the target is >= the queue depth (caps nothing)
    adaptive_batch: bool = False
    aging: float = 0.95  # key multiplier per step waited
    # NOTE: the write-up's 200 ms cost goodput (docs/scheduling.md)
    max_wait_s: float = flag(
        2.0,
        "--max-wait",
        "Starvation bound, seconds: every request is offered a step after waiting this long.",
    )
    length_weight_s: float = 1e-4  # seconds of urgency per prompt token
    default_ttft_s: float = 2.0  # first-token objective when a request gives none
    max_waiting: int = 1024  # admission: queue cap
    queue_timeout_s: float = 30.0  # admission: longest wait before refusal
    admission_control: bool = flag(
        True, "--admission-control", "Refuse early a request whose objectives cannot be met."
    )
    # Scheduler._run_length: the scheduler, output and IPC work is paid once per run.
    num_scheduler_steps: int = flag(
        DEFAULT_SCHEDULER_STEPS,
        "--num-scheduler-steps",
        "Decode steps run back to back per schedule while every running request "
        "decodes and none waits (the per-step scheduling and output work is paid "
        "once per run; tokens stream in runs of this many).",
    )

    speculation: str = flag(
        "off",
        "--speculation",
        "Draft tokens to verify each decode step: off, ngram (prompt lookup over the "
        "request's prompt and output), or auto (prompt lookup, as many drafts a step as "
        "the measured cost of verify rows and the batch size pay for). A request's own "
        "prediction is verified either way.",
        choices=SPECULATION_MODES,
    )
    num_speculative_tokens: int = flag(
        4,
        "--num-speculative-tokens",
        "Most draft tokens a request verifies per step (greedy requests only).",
    )
    prompt_lookup_min: int = flag(
        1, "--prompt-lookup-min", "ngram speculation: the shortest suffix n-gram looked up."
    )
    prompt_lookup_max: int = flag(
        4, "--prompt-lookup-max", "ngram speculation: the longest suffix n-gram looked up."
    )

    def __post_init__(self) -> None:
        require(
            self.prefill_order in PREFILL_ORDERS,
            "prefill_order",
            f"prefill order must be one of {', '.join(PREFILL_ORDERS)}, got {self.prefill_order!r}",
        )
        require(
            self.speculation in SPECULATION_MODES,
            "speculation",
            f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}",
        )
        require(
            1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            "num_speculative_tokens",
            f"num speculative tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
            f"got {self.num_speculative_tokens}",
        )
        require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "prompt_lookup_min",
            f"prompt lookup min must be >= 1 and <= prompt lookup max ({self.prompt_lookup_max}), "
            f"got {self.prompt_lookup_min}",
        )
        require(
            self.policy in POLICIES,
            "policy",
            f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}",
        )
        require(
            0.0 <= self.finish_margin < 1.0,
            "finish_margin",
            f"finish margin must be in [0, 1), got {self.finish_margin}",
        )
        require(self.max_batch >= 1, "max_batch", f"max batch must be >= 1, got {self.max_batch}")
        require(
            1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS,
            "num_scheduler_steps",
            f"num scheduler steps must be in [1, {MAX_SCHEDULER_STEPS}], got {self.num_scheduler_steps}",
        )
        require(
            self.max_batched_tokens >= 1, "max_batched_tokens", "max batched tokens must be >= 1"
        )
        require(self.prefill_chunk >= 1, "prefill_chunk", "prefill chunk must be >= 1")
        require(
            self.preemption_mode in ("swap", "recompute"),
            "preemption_mode",
            f"preemption mode must be 'swap' or 'recompute', got {self.preemption_mode!r}",
        )
        require(
            0.0 < self.batch_decay < 1.0,
            "batch_decay",
            f"batch decay must be in (0, 1), got {self.batch_decay}",
        )
        require(0.0 < self.aging <= 1.0, "aging", f"aging must be in (0, 1], got {self.aging}")
        require(
            math.isfinite(self.max_wait_s) and self.max_wait_s > 0,
            "max_wait_s",
            "max wait must be > 0 seconds",
        )
        require(self.length_weight_s >= 0, "length_weight_s", "length weight must be >= 0")
        require(self.max_waiting >= 1, "max_waiting", "max waiting must be >= 1")
        require(
            self.max_waiting <= MAX_QUEUE_CAPACITY,
            "max_waiting",
            f"max waiting must be <= {MAX_QUEUE_CAPACITY} (the hot-path queue's limit), got {self.max_waiting}",
        )
        require(self.queue_timeout_s > 0, "queue_timeout_s", "queue timeout must be > 0 seconds")


@dataclass(slots=True)
class ServerConfig:
    host: str = flag("127.0.0.1", "--host", "Address to bind (0.0.0.0 for all).")
    port: int = flag(50051, "--port", "gRPC port (0 picks a free one).")
    metrics_port: int | None = flag(
        9464, "--metrics-port", "Prometheus port, or 'off'.", parse=port_or_off
    )
    max_message_bytes: int = 16 * 1024**2
    max_prompt_tokens: int | None = flag(
        None, "--max-prompt-tokens", "Longest prompt accepted [default: context length]."
    )
    max_tokens_limit: int = flag(4096, "--max-tokens-limit", "Largest max_tokens accepted.")
    max_logprobs: int = flag(
        20,
        "--max-logprobs",
        "Most top log-probabilities per token a request may ask for (logprobs, top_logprobs).",
    )
    max_n: int = flag(16, "--max-n", "Most choices (n) one request may ask for.")
    max_score_candidates: int = flag(
        64,
        "--max-score-candidates",
        "Most candidates one score call (/v1/score, LLM.score) may send.",
    )
    # Stop strings: OpenAI takes 4, TGI 4 by default; 16 leaves room for a chat template's end
    # markers plus a client's own, and 256 characters for any delimiter. At the limit a
    # request's automaton has <= 4096 nodes.
    max_stop_strings: int = flag(
        16, "--max-stop-strings", "Most stop strings one request may give (0: none allowed)."
    )
    max_stop_string_chars: int = flag(
        256, "--max-stop-string-chars", "Longest stop string accepted, in characters."
    )
    max_stop_token_ids: int = flag(
        64, "--max-stop-token-ids", "Most stop_token_ids one request may give (0: none allowed)."
    )
    max_prompts_per_request: int = flag(
        64,
        "--max-prompts-per-request",
        "Most prompts one /v1/completions request may batch (a list of prompts).",
    )
    auth_token: str | None = flag(
        None,
        "--auth-token",
        "Require 'authorization: Bearer TOKEN' on every call (--api-key: vLLM's name for it).",
        aliases=("--api-key",),
        envvar="SLOSERVE_AUTH_TOKEN",
    )
    tls_cert: str | None = flag(
        None, "--tls-cert", "PEM certificate chain (TLS on; needs --tls-key)."
    )
    tls_key: str | None = flag(None, "--tls-key", "PEM private key of --tls-cert.")
    tls_ca: str | None = flag(
        None,
        "--tls-ca",
        "PEM CA certificates: clients must present a certificate signed by "
        "one of them (mTLS) on the gRPC, HTTP and metrics ports; needs --tls-cert.",
    )
    metrics_host: str | None = flag(
        None,
        "--metrics-host",
        "Address the Prometheus port binds, e.g. 127.0.0.1 to keep it local [default: --host].",
    )
    metrics_token: str | None = flag(
        None,
        "--metrics-token",
        "Require 'authorization: Bearer TOKEN' on the Prometheus port [default: open].",
        envvar="SLOSERVE_METRICS_TOKEN",
    )
    grace_s: float = flag(
        10.0, "--grace", "Seconds in-flight requests get to finish on SIGTERM/SIGINT."
    )
    log_format: str = flag(
        "text", "--log-format", "Log lines as text or JSON.", choices=("text", "json")
    )
    engine_process: bool = flag(
        True,
        "--engine-process",
        "Run the engine in a process of its own (off: a thread of the server process).",
    )
    idle_spin_s: float = flag(
        1.0,
        "--idle-spin",
        "The engine process keeps polling for input this long after its last step before it sleeps: "
        "a core kept awake serves the next prompt at full speed (0: sleep at once, to spare the CPU).",
    )
    frontends: int = flag(
        1,
        "--frontends",
        "Front-end processes (gRPC + HTTP intake, tokenizing) sharing one engine process and the same "
        "ports (SO_REUSEPORT): more requests a second can be taken in and refused. Each serves its own "
        "metrics, front end k on --metrics-port + k.",
        metavar="N",
    )
    metrics_compat: str = flag(
        "none",
        "--metrics-compat",
        "vllm: also export the vllm:-named series gateways (the Inference Extension's endpoint picker) "
        "and dashboards scrape.",
        choices=("none", "vllm"),
    )
    served_model_name: str | None = flag(
        None,
        "--served-model-name",
        "Model id of the HTTP API [default: --model].",
    )

    def __post_init__(self) -> None:
        require(0 <= self.port < 65536, "port", f"port must be in 0..65535, got {self.port}")
        require(
            self.metrics_port is None or 0 <= self.metrics_port < 65536,
            "metrics_port",
            "metrics port must be in 0..65535",
        )
        require(
            (self.tls_cert is None) == (self.tls_key is None),
            "tls_key",
            "TLS needs both --tls-cert and --tls-key",
        )
        require(
            self.tls_ca is None or self.tls_cert is not None,
            "tls_ca",
            "tls ca (client certificates) needs TLS on: give --tls-cert and --tls-key too",
        )
        require(
            self.metrics_token is None or bool(self.metrics_token.strip()),
            "metrics_token",
            "metrics token must not be empty",
        )
        require(
            self.log_format in ("text", "json"), "log_format", "log format must be 'text' or 'json'"
        )
        require(
            self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
            "max_prompt_tokens",
            "must be >= 1",
        )
        require(self.max_tokens_limit >= 1, "max_tokens_limit", "max tokens limit must be >= 1")
        require(
            self.max_logprobs >= 0,
            "max_logprobs",
            f"max logprobs must be >= 0, got {self.max_logprobs}",
        )
        require(self.max_n >= 1, "max_n", f"max n must be >= 1, got {self.max_n}")
        require(
            self.max_score_candidates >= 1,
            "max_score_candidates",
            f"max score candidates must be >= 1, got {self.max_score_candidates}",
        )
        require(
            self.max_stop_strings >= 0,
            "max_stop_strings",
            f"max stop strings must be >= 0, got {self.max_stop_strings}",
        )
        require(
            self.max_stop_string_chars >= 1,
            "max_stop_string_chars",
            f"max stop string chars must be >= 1, got {self.max_stop_string_chars}",
        )
        require(
            self.max_stop_token_ids >= 0,
            "max_stop_token_ids",
            f"max stop token ids must be >= 0, got {self.max_stop_token_ids}",
        )
        require(
            self.max_prompts_per_request >= 1,
            "max_prompts_per_request",
            f"max prompts per request must be >= 1, got {self.max_prompts_per_request}",
        )
        require(self.grace_s >= 0, "grace_s", "must be >= 0 seconds")
        require(
            0 <= self.idle_spin_s <= 60,
            "idle_spin_s",
            f"idle spin must be in 0..60 seconds, got {self.idle_spin_s}",
        )
        require(
            1 <= self.frontends <= 64,
            "frontends",
            f"frontends must be in 1..64, got {self.frontends}",
        )
        require(
            self.frontends == 1 or self.engine_process,
            "frontends",
            "frontends > 1 needs the engine in a process of its own (drop --no-engine-process)",
        )
        require(
            self.metrics_compat in ("none", "vllm"),
            "metrics_compat",
            f"metrics compat must be none or vllm, got {self.metrics_compat!r}",
        )


@dataclass(slots=True)
class GrpcConfig:
    """What one gRPC client may hold: streams, requests, queued output, idle time (docs/threat-model.md).

    Durations are seconds; 0 turns an idle or age limit off.
    """

    max_request_id_length: int = flag(
        256,
        "--grpc-max-request-id-length",
        "Longest request_id accepted, in characters (printable ASCII only).",
    )
    max_streams: int = flag(
        1024,
        "--grpc-max-streams",
        "Stream calls open at once, server-wide; more are refused RESOURCE_EXHAUSTED.",
    )
    max_streams_per_connection: int = flag(
        128,
        "--grpc-max-streams-per-connection",
        "Concurrent calls on one connection (HTTP/2 MAX_CONCURRENT_STREAMS; more wait at the client).",
    )
    max_connections: int = flag(
        1024, "--grpc-max-connections", "Connections open at once; more are closed at accept."
    )
    max_requests_per_stream: int = flag(
        512,
        "--grpc-max-requests-per-stream",
        "Requests live on one Stream; more are refused RESOURCE_EXHAUSTED.",
    )
    stream_queue: int = flag(
        256,
        "--grpc-stream-queue",
        "Messages waiting to be written on one Stream before the server stops reading it "
        "(back-pressure).",
    )
    stream_stall_s: float = flag(
        30.0,
        "--grpc-stream-stall-timeout",
        "Seconds one write may wait for a client that reads nothing before its Stream ends "
        "RESOURCE_EXHAUSTED.",
    )
    stream_idle_s: float = flag(
        600.0,
        "--grpc-stream-idle-timeout",
        "Seconds a Stream may stay open with no live request and no message before it ends "
        "UNAVAILABLE (0: never).",
    )
    max_connection_idle_s: float = flag(
        900.0,
        "--grpc-max-connection-idle",
        "Seconds a connection with no call stays open (then GOAWAY; 0: forever).",
    )
    max_connection_age_s: float = flag(
        0.0,
        "--grpc-max-connection-age",
        "Seconds a connection may live (then GOAWAY; 0: forever).",
    )
    max_connection_age_grace_s: float = flag(
        300.0,
        "--grpc-max-connection-age-grace",
        "Seconds the calls of a connection past its age get to finish.",
    )
    keepalive_time_s: float = flag(
        60.0,
        "--grpc-keepalive-time",
        "Seconds between the server's pings on a quiet connection (finds dead peers).",
    )
    keepalive_timeout_s: float = flag(
        20.0,
        "--grpc-keepalive-timeout",
        "Seconds a ping may go unanswered before the connection is closed.",
    )
    min_ping_interval_s: float = flag(
        10.0,
        "--grpc-min-ping-interval",
        "Clients that ping more often than this without data are sent GOAWAY (too_many_pings).",
    )

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
            require(1 <= value <= 2**31 - 1, name, f"must be in 1..2147483647, got {value}")
        for name in ("stream_stall_s", "keepalive_time_s", "keepalive_timeout_s"):
            value = getattr(self, name)
            require(math.isfinite(value) and value > 0, name, f"must be > 0 seconds, got {value}")
        for name in (
            "stream_idle_s",
            "max_connection_idle_s",
            "max_connection_age_s",
            "max_connection_age_grace_s",
            "min_ping_interval_s",
        ):
            value = getattr(self, name)
            require(
                math.isfinite(value) and value >= 0,
                name,
                f"must be >= 0 seconds (0: off), got {value}",
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

    tensor_parallel_size: int = flag(
        1,
        "--tensor-parallel-size",
        "Ranks the model is split over (one process each; gloo on a CPU, NCCL on GPUs).",
        aliases=("-tp",),
    )
    nnodes: int = flag(
        1, "--nnodes", "Machines the tensor-parallel ranks span (torchrun's convention)."
    )
    node_rank: int = flag(
        0,
        "--node-rank",
        "This machine's index among --nnodes: 0 serves; the others only run their ranks.",
    )
    master_addr: str = flag(
        "127.0.0.1",
        "--master-addr",
        "Address of node 0, where the ranks meet (bind address on node 0).",
    )
    master_port: int | None = flag(
        None,
        "--master-port",
        "Port on node 0 where the ranks meet [default: a free one; required with --nnodes > 1].",
    )

    def __post_init__(self) -> None:
        require(
            self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            f"tensor parallel size must be >= 1, got {self.tensor_parallel_size}",
        )
        require(self.nnodes >= 1, "nnodes", f"nnodes must be >= 1, got {self.nnodes}")
        require(
            self.tensor_parallel_size % self.nnodes == 0,
            "tensor_parallel_size",
            f"tensor parallel size {self.tensor_parallel_size} must be a multiple of nnodes {self.nnodes} "
            "(every node runs the same number of ranks)",
        )
        require(
            0 <= self.node_rank < self.nnodes,
            "node_rank",
            f"node rank must be in 0..{self.nnodes - 1}, got {self.node_rank}",
        )
        require(
            self.master_port is None or 0 < self.master_port < 65536,
            "master_port",
            f"master port must be in 1..65535, got {self.master_port}",
        )
        require(
            self.nnodes == 1 or self.master_port is not None,
            "master_port",
            "master port must be given when tensor parallelism spans nodes (--master-port)",
        )

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


MAX_LORA_RANK = 256


def parse_lora_modules(text: str) -> tuple[tuple[str, str], ...]:
    """'name=path name2=path2' (spaces or commas between) -> ((name, path), ...)."""
    pairs = []
    for item in text.replace(",", " ").split():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"must be name=path pairs, got {item!r}")
        pairs.append((name, path))
    return tuple(pairs)


@dataclass(slots=True)
class LoraConfig:
    """LoRA adapters served beside the base model (docs/design/lora.md)."""

    lora_modules: str = flag(
        "",
        "--lora-modules",
        "Adapters to load at start-up, as name=path pairs separated by spaces or commas (PEFT "
        "folders: adapter_config.json + adapter_model.safetensors); a request names one in "
        "its `model` field.",
        metavar="NAME=PATH",
    )
    lora_dir: str | None = flag(
        None,
        "--lora-dir",
        "The folder adapters are loaded from through POST /v1/load_lora_adapter (paths outside "
        "it are refused; without it the API loads none).",
    )
    max_lora_rank: int = flag(
        MAX_LORA_RANK,
        "--max-lora-rank",
        f"The largest adapter rank loaded (1 to {MAX_LORA_RANK}).",
    )

    def __post_init__(self) -> None:
        require(
            1 <= self.max_lora_rank <= MAX_LORA_RANK,
            "max_lora_rank",
            f"must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}",
        )
        try:
            modules = parse_lora_modules(self.lora_modules)
        except ValueError as exc:
            raise ConfigError("lora_modules", str(exc)) from None
        names = [name for name, _ in modules]
        require(
            len(set(names)) == len(names),
            "lora_modules",
            f"must name each adapter once, got {', '.join(names)}",
        )

    @property
    def modules(self) -> tuple[tuple[str, str], ...]:
        """(name, path) of each start-up adapter."""
        return parse_lora_modules(self.lora_modules)


@dataclass(slots=True)
class SloserveConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    grpc: GrpcConfig = field(default_factory=GrpcConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

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
