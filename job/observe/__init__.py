"""What a run shows while it runs: console and TensorBoard (``metrics``), and per-step cross-rank
statistics, stragglers, profiler windows and collective-timeout reports (``observer``)."""
