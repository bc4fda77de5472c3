"""Runs over seeds and their statistics: launch the seeds, then list, copy, plot, tabulate, pair and plan the power."""
