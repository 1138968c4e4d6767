"""What only the benchmark scripts use, beside them (not installed): :mod:`lab.figures` (their
``--json FILE`` / ``--plot DIR``), :mod:`lab.process_sampler` (CPU and wake-ups of process trees),
:mod:`lab.netns` (network namespaces with a shaped link), :mod:`lab.lru_replay` (LRU cache
replays for placement studies). A script run as ``python benchmarks/NAME.py`` imports them as
``lab.*``; tests put ``benchmarks/`` on ``sys.path`` (``tests/conftest.py``)."""
