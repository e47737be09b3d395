"""Measuring and reporting: where time and memory go, the collectives' probe, the tables, plots and report."""
