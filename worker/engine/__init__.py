"""The engine core: requests in, tokens out, on one step thread that owns the model, cache and scheduler.

`engine.Engine` holds both the caller side (validation, tokenization, admission) and the step loop.
The package re-exports nothing: import the module that holds a name.
"""
