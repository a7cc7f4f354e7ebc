"""The engine core: requests in, tokens out, on one step thread that owns the model, cache and scheduler.

`engine.Engine` is the caller side (validation, tokenization, admission, the generate/submit API);
`step_loop.StepLoop` is the step thread. They share only the command queue and `step_loop.InFlight`.
The package re-exports nothing: import the module that holds a name.
"""
