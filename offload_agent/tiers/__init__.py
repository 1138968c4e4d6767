"""The CPU and SSD tiers of KV blocks behind vLLM's prefix cache.

Who owns what (one vLLM engine, one set of tiers):

- Placement: the KV connector (:mod:`offload_agent.connector`, loaded by vLLM from
  ``kv_connector_module_path``). Its scheduler side owns the bookkeeping (:class:`TierPlanner`:
  which block is where, LRU, byte limits) and is the only one that evicts; its worker side writes
  the bytes (:class:`TierStore`: the CPU slots and the SSD files) and executes the planner's
  operations in order.
- Memory: with an offload agent on the connector's ``agent_socket`` (:mod:`offload_agent.tier_service`),
  the agent owns the storage: it creates the CPU tier's shared memory file
  (:mod:`offload_agent.tiers.shm_slab`: header, slot table with a seqlock per slot, slots), which
  the connector maps, and names the SSD folder; it is the only one that removes the file; it
  reads slots and files only to serve peers (:mod:`offload_agent.peer`). Without an agent the
  connector allocates the CPU slab in its own memory and uses the configured SSD folder, as
  before; nothing else changes.
- Residency reaches the index from vLLM's own KV event stream: the connector injects
  ``BlockStored``/``BlockRemoved`` events with medium ``CPU`` or ``STORAGE`` (vLLM's names), which
  the existing translator maps to tiers ``cpu``/``ssd``. So tier residency reaches the index by the
  same path, with the same gap repair, as GPU residency, with or without an agent.
- After a restart the connector rebuilds its planner from the SSD files
  (:func:`scan_fingerprint_dir`, ignoring other fingerprints) and, with an agent, from the CPU
  tier file's stable slots. Two vLLM engines must not be given the same SSD folder or CPU tier
  file with the same model (they would evict each other's blocks without knowing).

The sizes come from ``kvroute up --cpu-tier-bytes/--ssd-tier-dir/--ssd-tier-bytes``, which end up in
vLLM's ``--kv-transfer-config`` (:func:`offload_agent.connector.config.kv_transfer_config`) and, when
agents own the tiers, in each ``kvroute agent --tier-socket`` command line.
"""
from offload_agent.tiers.keys import KEY_BYTES, TierFingerprint, tier_block_keys, tier_root
from offload_agent.tiers.planner import CPU, SSD, Change, TierPlanner
from offload_agent.tiers.ssd_file import (HEADER_BYTES, CorruptBlockError, read_block_file,
                                          scan_fingerprint_dir, write_block_file)
from offload_agent.tiers.store import TierStore

__all__ = ["KEY_BYTES", "TierFingerprint", "tier_block_keys", "tier_root", "CPU", "SSD", "Change",
           "TierPlanner", "HEADER_BYTES", "CorruptBlockError", "read_block_file",
           "scan_fingerprint_dir", "write_block_file", "TierStore"]
