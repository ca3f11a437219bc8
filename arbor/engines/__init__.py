"""Rollout engines: SGLang (GPU) or arbor's embedded engine, both behind SGLang's native API."""
