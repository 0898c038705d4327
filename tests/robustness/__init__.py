"""The robustness campaign (`make soak`, docs/robustness.md): a real cluster of three brokers and
five nodes in network namespaces, every workload at once, faults by the seed, checks after."""
