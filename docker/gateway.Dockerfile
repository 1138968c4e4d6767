# kvroute (gateway and agent) image for docker-compose.yml: `kvroute serve` / `kvroute agent`.
FROM python:3.11-slim
WORKDIR /opt/kvroute
COPY pyproject.toml README.md ./
COPY kvcore ./kvcore
COPY router ./router
COPY offload_agent ./offload_agent
COPY simulator ./simulator
COPY kvroute ./kvroute
RUN pip install --no-cache-dir .
ENTRYPOINT ["kvroute"]
