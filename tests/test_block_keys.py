"""Block keys are a wire format (stored in Redis, computed by gateway and agent): pin the encoding."""
import os
import random
import struct

import pytest
import xxhash

from kvcore.block_keys import NATIVE, BlockExtras, block_keys, root_key


def _by_hand(tokens, bs, model, salt=None, lora=None):
    """The encoding as the module docstring states it, written out independently."""
    key = xxhash.xxh3_64_intdigest(b"kvroute/v1\x00" + model.encode())
    out = []
    for i in range(len(tokens) // bs):
        data = struct.pack("<Q", key) + struct.pack(f"<{bs}I", *tokens[i * bs:(i + 1) * bs])
        if lora is not None:
            raw = lora.encode()
            data += b"L" + struct.pack("<I", len(raw)) + raw
        if salt is not None and i == 0:
            raw = salt.encode()
            data += b"S" + struct.pack("<I", len(raw)) + raw
        key = xxhash.xxh3_64_intdigest(data)
        out.append(key)
    return out


def test_only_full_blocks_are_keyed():
    assert len(block_keys(list(range(95)), 32, "m")) == 2
    assert len(block_keys(list(range(96)), 32, "m")) == 3
    assert block_keys(list(range(31)), 32, "m") == []


def test_encoding_matches_docstring():
    tokens = [7, 300, 65535, 2**32 - 1] * 24
    assert block_keys(tokens, 32, "tiny") == _by_hand(tokens, 32, "tiny")
    salted = block_keys(tokens, 32, "tiny", BlockExtras(cache_salt="s1"))
    assert salted == _by_hand(tokens, 32, "tiny", salt="s1")
    lora = block_keys(tokens, 32, "tiny", BlockExtras(lora_name="ad"))
    assert lora == _by_hand(tokens, 32, "tiny", lora="ad")


def test_pinned_values():
    # Frozen: changing these breaks every Redis index written by an older version.
    assert root_key("tiny") == xxhash.xxh3_64_intdigest(b"kvroute/v1\x00tiny")
    assert block_keys(list(range(64)), 32, "tiny") == [8144398330449934709, 2545983542052384394]


def test_chain_depends_on_prefix_model_and_extras():
    a = block_keys(list(range(64)), 32, "tiny")
    b = block_keys([1] + list(range(1, 64)), 32, "tiny")
    assert a[0] != b[0] and a[1] != b[1]  # block 1 identical tokens, but its parent differs
    assert block_keys(list(range(64)), 32, "other") != a
    salt_x = block_keys(list(range(64)), 32, "tiny", BlockExtras(cache_salt="x"))
    lora_x = block_keys(list(range(64)), 32, "tiny", BlockExtras(lora_name="x"))
    assert len({a[0], salt_x[0], lora_x[0]}) == 3  # tags keep a LoRA "x" apart from a salt "x"


def test_continuing_a_chain_from_a_parent_equals_the_whole_chain():
    tokens = list(range(160))
    whole = block_keys(tokens, 32, "tiny", BlockExtras(cache_salt="z"))
    tail = block_keys(tokens[64:], 32, "tiny", BlockExtras(cache_salt="z"), parent=whole[1],
                      first_block_index=2)
    assert tail == whole[2:]


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError):
        block_keys([1, 2], 0, "m")
    with pytest.raises(ValueError):
        block_keys([-1] * 32, 32, "m")
    with pytest.raises(ValueError):
        block_keys([2**32] + [0] * 31, 32, "m")
    with pytest.raises(ValueError):
        block_keys([1.5] * 32, 32, "m")
    assert block_keys([0] * 32 + [-1], 32, "m") == block_keys([0] * 32, 32, "m")  # a partial block is not read


def test_any_sequence_of_ints_gives_the_same_keys():
    import numpy as np
    tokens = [7, 300, 65535, 2**32 - 1, 0, 1] * 20
    want = _by_hand(tokens, 16, "tiny")
    assert block_keys(tuple(tokens), 16, "tiny") == want
    assert block_keys(np.array(tokens, dtype=np.uint32), 16, "tiny") == want
    assert block_keys(np.array(tokens, dtype=np.int64), 16, "tiny") == want


def _python_loop(monkeypatch, *args, **kw):
    import kvcore.block_keys as bk
    monkeypatch.setattr(bk, "_native_chain", None)
    try:
        return block_keys(*args, **kw)
    finally:
        monkeypatch.undo()


@pytest.mark.skipif(not os.path.exists("/usr/include/xxhash.h"), reason="xxhash.h (libxxhash-dev) not installed")
def test_the_c_chain_is_built_where_xxhash_h_is():
    import kvcore.block_keys as bk
    assert bk.NATIVE  # make install-system installs libxxhash-dev; pip install -e . builds it


@pytest.mark.skipif(not NATIVE, reason="the C chain is not built here")
@pytest.mark.parametrize("block_size", [1, 3, 16, 32, 1025, 2048])  # 1,025 and up: past its stack buffer
def test_the_c_chain_gives_the_python_loops_keys(monkeypatch, block_size):
    rng = random.Random(block_size)
    for n_tokens in (0, block_size - 1, block_size, 5 * block_size + 2, 40 * block_size):
        tokens = [rng.choice((0, 1, 2**31, 2**32 - 1, rng.randrange(2**32))) for _ in range(n_tokens)]
        for parent in (None, 0, 1, 2**63, 2**64 - 1):
            got = block_keys(tokens, block_size, "tiny", parent=parent)
            assert got == _python_loop(monkeypatch, tokens, block_size, "tiny", parent=parent)
            assert len(got) == n_tokens // block_size
    assert block_keys(list(range(64)), 32, "tiny") == [8144398330449934709, 2545983542052384394]


@pytest.mark.skipif(not NATIVE, reason="the C chain is not built here")
def test_the_c_chain_refuses_what_the_python_loop_refuses(monkeypatch):
    from kvcore._block_keys_native import chain
    for parent in (-1, 2**64):
        with pytest.raises(OverflowError):
            block_keys([1] * 32, 32, "m", parent=parent)
        with pytest.raises(OverflowError):
            _python_loop(monkeypatch, [1] * 32, 32, "m", parent=parent)
    with pytest.raises(ValueError):
        chain(b"\0" * 10, 4, 0)  # not a whole number of blocks
    with pytest.raises(ValueError):
        chain(b"", 0, 0)
    with pytest.raises(TypeError):
        chain("text", 4, 0)
    assert chain(b"", 4, 7) == []
    assert block_keys([1] * 31, 32, "m", parent=-1) == []  # no full block: the parent is never read
