"""Generated test/benchmark models, made once and cached: ``ensure_model(size, vllm_python)``.

The generator (:mod:`tools.make_model`, beside this file) needs torch, so it runs in a subprocess
with the vLLM virtualenv's interpreter; this module itself imports nothing heavy and is what the
tests and benchmarks call. Models live under ``<repo>/.cache/models/<size>-seed<seed>`` (git-ignored)
and are rebuilt when the generator's version changes. Writing goes to a temporary sibling that is
renamed into place, so concurrent callers never see a half-written directory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GENERATOR = Path(__file__).resolve().parent / "make_model.py"
DEFAULT_CACHE = REPO / ".cache" / "models"
GENERATE_TIMEOUT_S = 300


def generator_version() -> int:
    """``GENERATOR_VERSION`` of make_model.py, read from its source (no torch import here)."""
    m = re.search(r"^GENERATOR_VERSION = (\d+)$", GENERATOR.read_text(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"no GENERATOR_VERSION in {GENERATOR}")
    return int(m.group(1))


def _is_current(model_dir: Path, size: str, seed: int, sliding_window: int | None = None) -> bool:
    try:
        meta = json.loads((model_dir / "kvroute_model.json").read_text())
    except (OSError, ValueError):
        return False
    want = {"generator_version": generator_version(), "size": size, "seed": seed}
    if sliding_window is not None:
        want["sliding_window"] = sliding_window
    return meta == want


def ensure_model(size: str = "tiny", vllm_python: str | None = None, seed: int = 0,
                 cache_dir: Path | None = None, sliding_window: int | None = None) -> Path:
    """The model directory for ``size`` ("tiny" | "small") and ``seed``, generated if missing/stale;
    ``sliding_window``: a hybrid model whose every other layer has this window (tokens).

    ``vllm_python``: interpreter with torch + transformers + tokenizers (default ``$KVR_VLLM_PYTHON``).
    Raises RuntimeError when that interpreter is missing or the generator fails (its output is in
    the message).
    """
    cache_dir = Path(cache_dir or DEFAULT_CACHE)
    target = cache_dir / (f"{size}-seed{seed}" + (f"-sw{sliding_window}" if sliding_window is not None else ""))
    if _is_current(target, size, seed, sliding_window):
        return target
    python = vllm_python or os.environ.get("KVR_VLLM_PYTHON")
    if not python or shutil.which(python) is None:
        raise RuntimeError(f"need an interpreter with torch to generate the {size!r} model "
                           f"(got {python!r}; set KVR_VLLM_PYTHON)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{size}-", dir=cache_dir))
    try:
        window = ["--sliding-window", str(sliding_window)] if sliding_window is not None else []
        done = subprocess.run([python, str(GENERATOR), str(tmp), "--size", size, "--seed", str(seed), *window],
                              capture_output=True, text=True, timeout=GENERATE_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"make_model.py failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another caller renamed its copy first
            if not _is_current(target, size, seed, sliding_window):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


LORA_GENERATOR = Path(__file__).resolve().parent / "make_lora.py"


def ensure_lora(base: Path, seed: int, vllm_python: str | None = None, rank: int = 8) -> Path:
    """A LoRA adapter for the generated model at ``base`` (:mod:`tools.make_lora`), made once under
    ``<base>-lora<seed>-r<rank>`` beside it and remade when missing or written for another base.
    Raises RuntimeError as :func:`ensure_model` does."""
    base = Path(base).resolve()
    return _ensure_beside(base, f"lora{seed}-r{rank}", "kvroute_lora.json", {"seed": seed, "rank": rank, "base": str(base)},
                          LORA_GENERATOR, ["--seed", str(seed), "--rank", str(rank)], "a LoRA adapter", vllm_python)


VLM_GENERATOR = Path(__file__).resolve().parent / "make_vlm.py"


def ensure_vlm(base: Path, seed: int = 0, vllm_python: str | None = None) -> Path:
    """A vision-language model (Idefics3 layout) built on the generated model at ``base``
    (:mod:`tools.make_vlm`), made once under ``<base>-vlm<seed>`` beside it and remade when missing
    or written for another base. Raises RuntimeError as :func:`ensure_model` does."""
    base = Path(base).resolve()
    return _ensure_beside(base, f"vlm{seed}", "kvroute_vlm.json", {"seed": seed, "base": str(base)},
                          VLM_GENERATOR, ["--seed", str(seed)], "a vision-language model", vllm_python)


def _ensure_beside(base: Path, suffix: str, meta_name: str, want: dict, generator: Path, flags: list[str],
                   what: str, vllm_python: str | None) -> Path:
    """``<base>-<suffix>`` beside ``base``, kept when its ``meta_name`` file holds ``want``, else
    written by ``generator BASE TMP *flags`` and renamed into place."""
    target = base.parent / f"{base.name}-{suffix}"
    try:
        if json.loads((target / meta_name).read_text()) == want:
            return target
    except (OSError, ValueError):
        pass
    python = vllm_python or os.environ.get("KVR_VLLM_PYTHON")
    if not python or shutil.which(python) is None:
        raise RuntimeError(f"need an interpreter with torch to generate {what} (got {python!r}; set KVR_VLLM_PYTHON)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=base.parent))
    try:
        done = subprocess.run([python, str(generator), str(base), str(tmp), *flags],
                              capture_output=True, text=True, timeout=GENERATE_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{generator.name} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another caller renamed its copy first
            if not (target / meta_name).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
