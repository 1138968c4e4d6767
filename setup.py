"""The optional C extensions; everything else is in pyproject.toml. ``optional=True``: where one
cannot be built (no C compiler; no xxhash.h, libxxhash-dev, for the block keys) the install goes
on without it, and its Python module uses its own path (kvcore.index.chain_rows: numpy;
kvcore.block_keys: a Python loop)."""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvcore.index._chain_native", ["kvcore/index/_chain_native.c"], extra_compile_args=["-O2"],
              optional=True),
    Extension("kvcore._block_keys_native", ["kvcore/_block_keys_native.c"], extra_compile_args=["-O2"],
              optional=True),
])
