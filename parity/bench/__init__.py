"""Benchmarks: both engines' performance at real dimensions, the CUDA check, check's verdict rates on correct and
faulty runs, the fitted-drafter acceptance run, full depth on the flash-shaped file, and `run` (the `bench`
command as one call).

The layer just below the CLI: may import every harness layer beneath it, `parity.api` included; imported only by
`parity.cli`.
"""
