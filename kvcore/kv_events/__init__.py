"""vLLM KV events into the cluster index: subscribe (with replay and restart detection), translate
to our block keys, write the index. Run by the offload agent and, in embedded mode, by the gateway.
"""
from kvcore.kv_events.ingest import EventIngestor, write_ops
from kvcore.kv_events.subscriber import EventSink, EventSubscriber
from kvcore.kv_events.translate import EventTranslator, IndexOp, TranslatorCounters

__all__ = ["EventIngestor", "EventSink", "EventSubscriber", "EventTranslator", "IndexOp",
           "TranslatorCounters", "write_ops"]
