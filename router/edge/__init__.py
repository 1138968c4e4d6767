"""DESIGN step 1, HTTP in: the ASGI app, the proxied OpenAI endpoints, the admin API, the OpenAPI
schema, the dashboard and client keys. The only package that knows ASGI and FastAPI."""
