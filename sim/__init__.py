"""The lakeFS-like model service and everything that drives the product: the model and its
workload, the embedded stack, the fault proxy, the demo, the soak, the benchmarks and test
support. No product package imports it (the CLI names its commands by module path)."""
