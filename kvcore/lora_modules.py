"""vLLM's ``--lora-modules`` flag as ``kvroute up`` and ``kvroute sim`` read it: each item is
``NAME=PATH`` or JSON with ``name`` and ``path`` (``LoRAParserAction``,
vllm/entrypoints/launchers/cli_args.py, 0.32)."""
from __future__ import annotations

import json


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """Adapter name -> path, in the order given; empty items are skipped as vLLM skips them.
    Raises ValueError naming an item that is neither form, lacks a name or path, or repeats a name."""
    out: dict[str, str] = {}
    for item in items:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
        else:
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (ValueError, TypeError, KeyError):
                raise ValueError(f"--lora-modules: {item!r} is neither NAME=PATH nor JSON with name and path") from None
        if not name or not path:
            raise ValueError(f"--lora-modules: {item!r} needs both an adapter name and a path")
        if name in out:
            raise ValueError(f"--lora-modules: adapter {name!r} is given twice")
        out[name] = path
    return out
