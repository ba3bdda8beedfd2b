"""LoRA adapters: read from PEFT's format, held per name, applied per row group in a batched step."""

from sloserve.lora.adapter import LoraAdapter, LoraDelta
from sloserve.lora.batch import LoraBatch
from sloserve.lora.peft_format import BaseHead
from sloserve.lora.registry import LoraRegistry

__all__ = ["BaseHead", "LoraAdapter", "LoraBatch", "LoraDelta", "LoraRegistry"]
