"""What the policies read besides the index, learned or derived, pure: per-worker prefill rates,
evidence trust, recent prefix uses, the worth of a block pulled from a peer."""
