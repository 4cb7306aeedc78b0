"""Workload and random-batch builders shared by tests, benchmarks and notebooks."""
