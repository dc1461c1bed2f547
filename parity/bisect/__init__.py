"""Finding a departure live: `bisect`'s search (which layer, sub-op, step: free-running screen, mirror splices,
teacher-forced attribution, sub-op drill-down), its report and printers (`bisect_report`), the step trajectory, and
`by_check`, which gives the report `check`'s verdict on the same run (one judgement).

Imports `parity.check` (the null, the envelope, sub-op comparison, `check` itself), `parity.contract`,
`parity.gguf`, `parity.tracing` and `parity.compare`, never `parity.logprobs` (its sibling layer); imported by
validate, api, bench and cli.
"""
