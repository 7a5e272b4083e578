"""Benchmark scripts, one per question; run as ``python -m benchmarks.<script>`` from the repo root."""
