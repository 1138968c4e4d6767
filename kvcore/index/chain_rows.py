"""Per-worker tier runs of a prompt from a matrix of holder rows, for lookups over many workers
or many holder changes (hundreds of workers each holding a different prefix length).

:func:`kvcore.index.memory.run_chains` walks the prompt's holder changes one Python int at a time:
about a dozen operations on a ``4 * workers``-bit int per change, ~2.5 ms for 1,024 changes at
1,024 workers. Here the changes are rows of one ``uint64`` matrix (the host index's holder sets
read straight from the shared file; the in-process index's ints and the Redis index's bitmaps
converted) and the three chains (gpu + speculative, gpu | cpu, any tier) are a handful of numpy
passes over it: each worker's run ends at the first row without its bit, found from the few
words where a bit drops. Each backend says when it takes this path.

Layout: a row holds ``4 * slots`` bits, bit ``4*slot + tier`` set when the worker in that slot
holds the block in that tier (0 gpu, 1 cpu, 2 ssd, 3 speculative), as
:class:`kvcore.index.memory.MemoryIndex`'s ints and :mod:`kvcore.index.host`'s holder sets.

:func:`row_matches` and :func:`matches_from_runs` run in C when the optional extension
``kvcore/index/_chain_native.c`` is built (``pip install`` builds it where a C compiler is found;
:data:`NATIVE` says whether it was): one pass over the rows and the result dict built directly,
with the same answers as the numpy passes here (``tests/test_chain_native.py`` compares them).
The host index also probes its key table there (``probe_ids``).
"""
from __future__ import annotations

import threading

import numpy as np

from kvcore.index.base import TierMatch

try:
    import kvcore.index._chain_native as native
except ImportError:  # not built (no C compiler at install time): the numpy passes below
    native = None
NATIVE = native is not None  # whether the C passes are in use (tests and benchmarks turn it off)

_STRIDE = 4  # bits per slot
_SLOTS_PER_WORD = 64 // _STRIDE
_LOW = 0x1111_1111_1111_1111  # bit 0 of every slot's nibble
# the tiers (nibble bits) of each chain: gpu or speculative; gpu, cpu or speculative; any
_CHAIN_TIERS = ((0, 3), (0, 1, 3), (0, 1, 2, 3))
_SPLITS_MAX = 1 << 16
_splits: dict[int, TierMatch] = {}  # (gpu, cpu, ssd) packed in one int -> its frozen TierMatch


class _Scratch(threading.local):
    """Work arrays kept between lookups, per thread. A lookup at 1,024 workers passes ~0.5 MiB
    arrays between numpy calls; allocated afresh, glibc maps and unmaps each one (past its mmap
    threshold), and the page faults cost about as much as the arithmetic."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        size = int(np.prod(shape))
        buf = self.arrays.get(name)
        if buf is None or buf.size < size:
            buf = self.arrays[name] = np.empty(max(size, 2 * (0 if buf is None else buf.size)), dtype)
        return buf[:size].reshape(shape)


scratch = _Scratch()


def chain_bits(rows: np.ndarray, tiers: tuple[int, ...], present: int) -> np.ndarray:
    """``(n, words)`` uint64: per row, one bit per slot (in its nibble), set when the slot
    holds the block in any of ``tiers``. ``present``: the OR of all rows; tiers absent from it
    cost nothing, and rows holding a single tier are their own chain."""
    tiers = tuple(t for t in tiers if present & (_LOW << t))
    if len(tiers) == 1 and not present & ~(_LOW << tiers[0]):
        return rows
    out = scratch.get("chain", rows.shape, np.uint64)
    if len(tiers) == 1:
        return np.bitwise_and(rows, np.uint64(_LOW << tiers[0]), out=out)
    shifted = scratch.get("shifted", rows.shape, np.uint64)
    np.right_shift(rows, np.uint64(tiers[0]), out=out)
    for t in tiers[1:]:
        np.bitwise_or(out, np.right_shift(rows, np.uint64(t), out=shifted), out=out)
    return np.bitwise_and(out, np.uint64(_LOW), out=out)


def run_lengths(rows: np.ndarray, starts: np.ndarray, end: int) -> np.ndarray:
    """Per chain and slot, the prompt's run from block 0: ``(3, words * 16)`` int64 blocks
    (chains: gpu or speculative, gpu, cpu or speculative, any tier).

    ``rows``: ``(n, words)`` uint64, the holder bits of block ``starts[r]`` (and of every block up
    to ``starts[r + 1]``, which hold the same); ``starts``: ``(n,)`` int64, increasing from 0;
    ``end``: the run's end in blocks (the first block nobody holds, or the prompt's length). A
    row of zeros ends every run there (callers end the run before one). Chains whose tiers the
    rows hold alike (a prompt held in gpu only) are computed once; a chain none of whose tiers
    the rows hold has runs of 0."""
    present = int(np.bitwise_or.reduce(rows, axis=None))
    runs = np.zeros((3, rows.shape[1] * _SLOTS_PER_WORD), np.int64)
    done: dict[tuple[int, ...], int] = {}
    for chain, tiers in enumerate(_CHAIN_TIERS):
        key = tuple(t for t in tiers if present & (_LOW << t))
        if not key:  # no row holds any of this chain's tiers (a prompt in cpu or ssd only)
            continue
        if key in done:
            runs[chain] = runs[done[key]]
            continue
        done[key] = chain
        _chain_runs(chain_bits(rows, tiers, present), starts, end, runs[chain])
    return runs


def _chain_runs(chain: np.ndarray, starts: np.ndarray, end: int, out: np.ndarray) -> None:
    """``out[slot]`` for each slot set in row 0 of ``chain`` (``(n, words)``, one bit per slot):
    ``starts[r]`` for the first row ``r`` without its bit, ``end`` when every row has it."""
    n, words = chain.shape
    first = chain[0]
    # the words where a slot's bit goes from set to clear at row r + 1, in row order
    dropped = np.invert(chain[1:], out=scratch.get("dropped", (n - 1, words), np.uint64))
    np.bitwise_and(dropped, chain[:-1], out=dropped)
    dropped = dropped.ravel()
    at = np.flatnonzero(np.not_equal(dropped, 0, out=scratch.get("flags", dropped.shape, np.bool_)))
    word = at % words
    values = dropped[at] & first[word]  # slots that were not in row 0 have no run to end
    keep = np.flatnonzero(values)
    at, word, values = at[keep], word[keep], values[keep]
    lengths = starts[at // words + 1]
    if ((values & (values - np.uint64(1))) == 0).all():
        # one slot per word, as usual: a power of two's position is float64's exponent, exactly
        slot = word * _SLOTS_PER_WORD + ((np.frexp(values.astype(np.float64))[1].astype(np.int64) - 1) >> 2)
    else:
        which, offset = _slots_set(values)  # in row order still
        slot = word[which] * _SLOTS_PER_WORD + offset
        lengths = lengths[which]
    # a slot that comes back and leaves again keeps its first run (the first occurrence)
    slot, first_at = np.unique(slot, return_index=True)
    out[slot] = lengths[first_at]
    alive = np.bitwise_and.reduce(chain, axis=0)  # set in every row: runs to the end
    alive_at = np.flatnonzero(alive)
    if alive_at.size:
        which, offset = _slots_set(alive[alive_at])
        out[alive_at[which] * _SLOTS_PER_WORD + offset] = end


def _slots_set(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``values`` (uint64 words, any bits of a slot's nibble counting for the slot), each
    slot with a bit set as (index into ``values``, slot within the word), in ``values``' order."""
    v = (values | values >> np.uint64(1) | values >> np.uint64(2) | values >> np.uint64(3)) & np.uint64(_LOW)
    bits = np.unpackbits(v.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")[:, ::_STRIDE]
    return np.nonzero(bits)


def lookup_paths() -> list[str]:
    """The lookup passes this install has: ``native`` (the C extension, when built) first, then
    ``numpy``. For benchmarks that time them side by side."""
    return ["native", "numpy"] if native is not None else ["numpy"]


def use_native(on: bool) -> bool:
    """Use the C passes (when built) or the numpy ones; returns whether the C passes are now in
    use. For side-by-side benchmarks and tests."""
    global NATIVE
    NATIVE = bool(on) and native is not None
    return NATIVE


def int_rows(masks: dict[int, int], keys: list[int], hidden: int, words: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The C walk of :meth:`kvcore.index.memory.MemoryIndex.match_sync`'s wide path (only when
    :data:`NATIVE`): per change of ``masks[key]`` (less ``hidden``'s bits) along ``keys``, a row
    of ``words`` uint64 words; returns (rows, their blocks, the run's end). No rows when block 0
    has no entry (or none left once hidden). The arrays are this thread's scratch, valid until
    its next lookup."""
    rows = scratch.get("int_rows", (len(keys), words), np.uint64)
    starts = scratch.get("int_starts", (len(keys),), np.int64)
    if hidden:
        hidden &= (1 << (64 * words)) - 1
    n, end = native.int_rows(masks, keys, hidden, rows, starts)
    return rows[:n], starts[:n], end


def row_matches(rows: np.ndarray, starts: np.ndarray, end: int, names: dict[int, str]) -> dict[str, TierMatch]:
    """:func:`matches_from_runs` of :func:`run_lengths` (same arguments): per named slot holding
    block 0 in some tier, its :class:`TierMatch`."""
    if NATIVE:
        return native.row_matches(rows, starts, end, names, _splits, _split)
    return _matches_from_runs(run_lengths(rows, starts, end), names)


def matches_from_runs(runs: np.ndarray, names: dict[int, str]) -> dict[str, TierMatch]:
    """Per named slot with a run in any tier, its :class:`TierMatch` from ``runs`` (``(3, slots)``
    int64: gpu, gpu|cpu and any-tier run lengths in blocks, each < 2**21). A TierMatch is
    frozen: one object serves every worker, and every lookup, with the same (gpu, cpu, ssd)."""
    if NATIVE:
        return native.runs_matches(runs, names, _splits, _split)
    return _matches_from_runs(runs, names)


def _matches_from_runs(runs: np.ndarray, names: dict[int, str]) -> dict[str, TierMatch]:
    held = np.flatnonzero(runs[2])
    g = runs[0, held]
    gc = np.maximum(runs[1, held], g)
    codes = ((g << 42) | ((gc - g) << 21) | (runs[2, held] - gc)).tolist()  # runs < 2**21 blocks
    get = _splits.get
    found = [get(code) or _split(code) for code in codes]
    out = dict(zip(map(names.get, held.tolist()), found))
    out.pop(None, None)  # slots without a name
    return out  # type: ignore[return-value]


def _split(code: int) -> TierMatch:
    """The frozen :class:`TierMatch` of a packed (gpu, cpu, ssd), kept for the next lookup (the
    cache is emptied past :data:`_SPLITS_MAX` entries)."""
    if len(_splits) >= _SPLITS_MAX:
        _splits.clear()
    mask = (1 << 21) - 1
    match = _splits[code] = TierMatch(code >> 42, (code >> 21) & mask, code & mask)
    return match
