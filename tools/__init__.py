"""Developer tools built on the compiler: the ``pass-debug`` CLI, graph dumps and benchmarks."""
