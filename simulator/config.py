"""Settings of one simulated vLLM server (what ``kvroute sim``'s flags fill in)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from simulator.events import KVEventsConfig
from simulator.timing import TimingModel

DEFAULT_BLOCK_SIZE = 16  # vLLM's default on GPUs
DEFAULT_NUM_GPU_BLOCKS = 8192
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM 0.32's API-server default on an H100 (arg_utils.py)
FALLBACK_MAX_MODEL_LEN = 4096
RECORDED_REQUESTS = 100  # bodies kept for GET /sim/requests


@dataclass
class SimConfig:
    """One simulated server. ``num_gpu_blocks`` counts vLLM's null block too; ``max_model_len``
    None means the model's ``max_position_embeddings`` (as vLLM derives it)."""

    model_dir: str
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int = DEFAULT_NUM_GPU_BLOCKS
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    enable_prompt_tokens_details: bool = False
    timing: TimingModel = field(default_factory=TimingModel)
    kv_load: str = "prompt"  # P/D: what a decode leg loads (simulator.engine.KV_LOAD_MODES)
    lora_modules: dict[str, str] = field(default_factory=dict)
    data_parallel_size: int = 1  # engines behind the one server, each its own KV cache (--data-parallel-size)  # LoRA adapter name -> path (--lora-modules)
    seed: int = 0
    recorded_requests: int = RECORDED_REQUESTS

    @property
    def model_name(self) -> str:
        """The name clients use (``--served-model-name``, else ``--model`` as given)."""
        return self.served_model_name or self.model_dir

    def resolved_max_model_len(self) -> int:
        """``max_model_len``, or the model config's ``max_position_embeddings``."""
        if self.max_model_len is not None:
            return self.max_model_len
        try:
            cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
            return int(cfg.get("max_position_embeddings") or FALLBACK_MAX_MODEL_LEN)
        except (OSError, ValueError, TypeError):
            return FALLBACK_MAX_MODEL_LEN
