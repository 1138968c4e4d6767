"""The CPU and SSD tiers of KV blocks behind vLLM's prefix cache.

Who owns what (one vLLM engine, one set of tiers):

- The tiers live in vLLM's process, behind our KV connector
  (:mod:`offload_agent.connector`, loaded by vLLM from ``kv_connector_module_path``). Its
  scheduler side owns the bookkeeping (:class:`TierPlanner`: which block is where, LRU, byte
  limits) and is the only one that evicts; its worker side owns the bytes (:class:`TierStore`:
  the CPU slab and the SSD files) and executes the planner's operations in order. KV never crosses
  a process boundary except into vLLM's own KV cache.
- The offload agent (or the gateway in embedded mode) learns residency from vLLM's own KV event
  stream: the connector injects ``BlockStored``/``BlockRemoved`` events with medium ``CPU`` or
  ``STORAGE`` (vLLM's names), which the existing translator maps to tiers ``cpu``/``ssd``. So
  tier residency reaches the index by the same path, with the same gap repair, as GPU residency,
  and works with or without an agent process.
- The SSD folder is shared with nothing at run time; after a restart the connector rebuilds its
  index from the files (:func:`scan_fingerprint_dir`), ignoring other fingerprints. Two vLLM
  engines must not be given the same SSD folder with the same model (they would evict each
  other's files without knowing).

The sizes come from ``kvroute up --cpu-tier-bytes/--ssd-tier-dir/--ssd-tier-bytes``, which end up in
vLLM's ``--kv-transfer-config`` (:func:`offload_agent.connector.config.kv_transfer_config`).
"""
from offload_agent.tiers.keys import KEY_BYTES, TierFingerprint, tier_block_keys, tier_root
from offload_agent.tiers.planner import CPU, SSD, Change, TierPlanner
from offload_agent.tiers.ssd_file import (HEADER_BYTES, CorruptBlockError, read_block_file,
                                          scan_fingerprint_dir, write_block_file)
from offload_agent.tiers.store import TierStore

__all__ = ["KEY_BYTES", "TierFingerprint", "tier_block_keys", "tier_root", "CPU", "SSD", "Change",
           "TierPlanner", "HEADER_BYTES", "CorruptBlockError", "read_block_file",
           "scan_fingerprint_dir", "write_block_file", "TierStore"]
