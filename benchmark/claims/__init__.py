"""Checks that reproduce or decide a paper's claim, or a claim of the docs, from runs, samples or probes."""
