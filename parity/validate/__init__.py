"""`v4parity validate`: the evidence an opt-in approximate path needs against the exact path, over many prompts.

spec (ENGINE:OPTS) -> prompts (boundary / file / corpus) -> worker (one prompt, both paths) -> executors
(serial / processes / Ray) -> store (JSONL as results arrive, resume) -> stats (bootstrap CI, MDE) ->
summary (aggregates, pins, budget) -> report (JSON, Markdown, plots). The driver ties them together.
"""
