"""The embedded engine (`arbor serve`): a small SGLang-API server for CPUs and laptops."""
