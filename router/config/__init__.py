"""The gateway's YAML config (DESIGN.md "Config"): :mod:`router.config.schema` (every section but
discovery) and :mod:`router.config.discovery`, pydantic models validated at start and by the admin API."""
