# kvroute (gateway and agent) image for docker-compose.yml: `kvroute serve` / `kvroute agent`.
# The wheel is built in a stage with a C compiler and xxhash.h (the index's lookups in C, kvcore/
# index/_chain_native.c; the chain of block keys, kvcore/_block_keys_native.c, which compiles the
# hash in); the image itself carries neither.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libxxhash-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvcore ./kvcore
COPY router ./router
COPY offload_agent ./offload_agent
COPY simulator ./simulator
COPY kvroute ./kvroute
COPY kvbench ./kvbench
RUN pip wheel --no-cache-dir --no-deps -w /wheels . \
 && python -c "import glob, zipfile; names = zipfile.ZipFile(glob.glob('/wheels/kvroute-*.whl')[0]).namelist(); \
assert any('_chain_native' in n for n in names), 'the C lookups were not built'; \
assert any('_block_keys_native' in n for n in names), 'the C block keys were not built'"

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
WORKDIR /opt/kvroute
ENTRYPOINT ["kvroute"]
