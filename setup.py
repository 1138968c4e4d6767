"""The optional C extension of the index's lookups (kvcore/index/_chain_native.c); everything
else is in pyproject.toml. ``optional=True``: where no C compiler is found the install goes on
and kvcore.index.chain_rows uses its numpy path."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("kvcore.index._chain_native", ["kvcore/index/_chain_native.c"],
                             extra_compile_args=["-O2"], optional=True)])
