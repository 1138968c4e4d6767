"""Block keys are a wire format (stored in Redis, computed by gateway and agent): pin the encoding."""
import struct

import pytest
import xxhash

from kvcore.block_keys import BlockExtras, block_keys, root_key


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
