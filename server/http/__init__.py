"""The HTTP edge: an OpenAI-compatible API (Starlette on uvicorn) over the front end (sloserve.frontend).

config.py its settings; server.py the uvicorn server, an Edge of the shared Lifecycle; app.py the
routes; schemas.py OpenAI JSON -> ParsedRequest; responses.py events -> OpenAI JSON; sse.py the
event-stream framing; errors.py FailureCode -> HTTP status in OpenAI's error shape; auth.py the
bearer token; slo.py objectives from headers and body.
"""
