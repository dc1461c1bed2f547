"""`check`'s package: the verdict on a candidate's trace (MATCH / NOISE / DEFECT) and what it stands on.

Holds the verdict pipeline (`check`), its report and printers (`check_report`), a cause's evidence as records
(`evidence`), the benign hypotheses and defect library (`hypotheses`; a fit's ties and structural differences as
records: `discrete`), the round-off null (`null`: Monte-Carlo twins, the binomial exceedance test; the null's test
and the discrete differences in words: `words`), op-level teacher forcing (`opforce`), the noise envelope
(`envelope`), sub-op comparison and QAT code flips (`subops`; a sub-op's findings as records: `subop_evidence`),
teacher-forced layer runs and attribution (`attribution`), draft-head checks (`draft_check`), the work pool's units
(`parallel`) and the inputs a check starts from (`inputs`: candidates, envelope lookup, preflight).

Imports contract, gguf, tracing and compare; imported by bisect (which localises live and takes `check`'s
verdict), spec, api and the CLI (pyproject.toml's layer contract).
"""
