"""LoRA adapters: read from PEFT's format, held per name, applied per row group in a batched step."""

from sloserve.lora.adapter import LoraAdapter, LoraDelta
from sloserve.lora.batch import LoraBatch
from sloserve.lora.registry import LoraRegistry

__all__ = ["LoraAdapter", "LoraBatch", "LoraDelta", "LoraRegistry"]
