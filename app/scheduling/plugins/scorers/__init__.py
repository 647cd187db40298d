"""Scorers: one raw value per candidate with a declared sense (min or max). See README.md."""
