"""The engine core: requests in, tokens out, on one step thread that owns the model, cache and scheduler.

`engine.Engine` is the caller's side (validation, tokenization, admission); `loop` is the step thread.
The package re-exports nothing: import the module that holds a name.
"""
