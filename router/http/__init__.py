"""The OpenAI-compatible HTTP front (`router --http-listen HOST:PORT`, docs/openai.md).

It runs in the router process on the router's own registry, balancer, limits and keys: a request is
parsed and validated (schema.py), mapped onto GenerateRequests (requests.py), relayed by the same
GenerationService.relay the gRPC front uses (relay.py), and rendered in OpenAI's shapes (responses.py);
errors keep OpenAI's shape with the status the gRPC code maps to (errors.py). app.py holds the routes,
server.py runs uvicorn as a task of the router's loop. Every accepted parameter is honored or refused by
name; nothing is silently ignored.
"""
