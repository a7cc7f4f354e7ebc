"""Startup checks: what a worker decides before and while it builds its engine.

`engine_setup` plans (`plan_startup`, every reason knowable before loading) and builds (`build_engine`);
`device` probes the accelerator; `kernel_check` and `kernel_warmup` test and warm the Triton kernels.
The package re-exports nothing: import the module that holds a name.
"""
