"""Checks of the repository itself: each script's size budget, the committed tables, same metrics across a refactor."""
